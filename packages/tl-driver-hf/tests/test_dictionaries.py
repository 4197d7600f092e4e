"""Dictionaries spliced into the hf driver's partial forwards: a transcoder's input belongs to
the forward that read it, and a split forward equals the whole one (tl-core's
``test_sae_partial_forwards.py`` checks the same on the native driver, with properties).

The reference is the plain transformers model with torch hooks running the dictionaries'
own math on its modules.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from tl_core import TransformerBridge, UserError
from tl_core.sae import random_dictionary


def test_split_forwards_with_dictionaries_equal_the_model_with_torch_hooks(
    bridge_of: Callable[[str], TransformerBridge],
    reference_of: Callable[[str], PreTrainedModel],
    ids: torch.Tensor,
) -> None:
    bridge, hf = bridge_of("llama"), reference_of("llama")
    width = bridge.cfg.d_model
    assert bridge.cfg.n_layers == 2
    sae = random_dictionary(width, 2 * width, seed=1)
    t = random_dictionary(width, 2 * width, seed=2, apply_b_dec_to_input=False, skip=True)
    other = torch.randint(4, 500, ids.shape, generator=torch.Generator().manual_seed(9))
    # The reference: block 0's output through the SAE; block 1's MLP output replaced by the
    # transcoder's reconstruction of block 0's MLP input (the second norm's output).
    seen: dict[str, torch.Tensor] = {}
    layers = hf.model.layers

    def block_out(module: Any, args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        new = sae.reconstruct(hidden)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    handles = [
        layers[0].register_forward_hook(block_out),
        layers[0].mlp.register_forward_pre_hook(lambda m, args: seen.__setitem__("in", args[0])),
        layers[1].mlp.register_forward_hook(lambda m, args, out: t.reconstruct(seen["in"])),
    ]
    try:
        with torch.no_grad():
            want = hf(input_ids=ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    splices = [
        bridge.add_sae(sae, hook_name="blocks.0.hook_out"),
        bridge.add_sae(
            t, hook_name="blocks.0.ln2.hook_out", output_hook_name="blocks.1.mlp.hook_out"
        ),
    ]
    try:
        with torch.no_grad():
            torch.testing.assert_close(bridge(ids), want, rtol=1e-5, atol=1e-5)
            # Split at block 2: both dictionaries run in the first half.
            residual = bridge(ids, stop_at_layer=2)
            bridge(other, stop_at_layer=1)  # reads other's transcoder input, then stops
            got = bridge(ids, start_at_layer=2, residual=residual)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            # Split at block 1: the transcoder's input is not in the residual: refused (it
            # used to decode the other batch's input here).
            residual = bridge(ids, stop_at_layer=1)
            bridge(other, stop_at_layer=1)
            with pytest.raises(
                UserError,
                match=re.escape(
                    "after 'blocks.0.ln2.hook_out', which the transcoder writing 'blocks.1.mlp.hook_out' reads"
                ),
            ):
                bridge(ids, start_at_layer=1, residual=residual)
            torch.testing.assert_close(bridge(ids), want, rtol=1e-5, atol=1e-5)
    finally:
        for s in splices:
            s.remove()
