"""``tl demo --native``: the mechanics on a small random native model, offline, in a second.

Boots a native model, captures every hook, edits an activation with a spec, runs the
residual-stream helpers and generates with steering. The weights are random, so the text
is noise; ``tl demo`` (without ``--native``) shows the same tools on a real model.
"""

from __future__ import annotations

import argparse
import time

__all__ = ["run"]

PROMPTS = ["The cat sat on the mat.", "Probes read minds"]


def _section(title: str) -> None:
    print(f"\n== {title} ==")


def run(args: argparse.Namespace) -> int:
    """Run the native demo (``args``: ``preset``, ``layers``, ``seed``); returns 0."""
    import torch

    with torch.no_grad():
        _tour(args)
    return 0


def _tour(args: argparse.Namespace) -> None:
    import torch

    from tl_core import InterventionSpec, TransformerBridge, available_drivers

    _section("drivers")
    print(", ".join(f"{n} ({r.distribution} {r.version})" for n, r in available_drivers().items()))

    _section("boot")
    start = time.perf_counter()
    model = TransformerBridge.boot_native(args.preset, n_layers=args.layers, seed=args.seed)
    print(f"{model!r} in {time.perf_counter() - start:.2f}s")

    _section("capture: run_with_cache on a ragged batch of 2 prompts")
    logits, cache = model.run_with_cache(PROMPTS)
    print(
        f"logits {tuple(logits.shape)}; {len(cache)} hooks cached; prompt lengths {cache.lengths}"
    )
    for name in (
        "embed.hook_out",
        "blocks.0.attn.hook_pattern",
        "blocks.1.hook_resid_post",
        "ln_final.hook_scale",
    ):
        print(f"  cache[{name!r}] -> {tuple(cache[name].shape)}")

    _section("intervention: suppress block 0's attention output at the last position")
    target = model.to_tokens(PROMPTS[0])
    clean_loss = model.loss(PROMPTS[0]).item()
    last = target.shape[1] - 1
    spec = {"blocks.0.attn.hook_out": {"op": "suppress", "pos": last}}
    edited, edited_cache = model.run_with_cache(
        PROMPTS[0], intervene=spec, names_filter=["blocks.0.attn.hook_out", "blocks.1.hook_out"]
    )
    clean = model(PROMPTS[0])
    moved = (edited[0, last] - clean[0, last]).abs().max().item()
    untouched = (edited[0, :last] - clean[0, :last]).abs().max().item()
    print(f"spec {spec}")
    print(
        f"max |logit change| at position {last}: {moved:.4f}; at positions 0..{last - 1}: {untouched:.1e}"
    )
    print(
        f"edited value at that position is zero: {bool((edited_cache['blocks.0.attn.hook_out'][0, last] == 0).all())}"
    )
    print(f"loss clean {clean_loss:.4f}")

    _section("the same spec language composes: scale then add, only at position 2")
    composed = [InterventionSpec.scale(0.5, pos=2), InterventionSpec.add(1.0, pos=2)]
    _, c2 = model.run_with_cache(
        PROMPTS[0],
        intervene={"blocks.1.mlp.hook_out": composed},
        names_filter="blocks.1.mlp.hook_out",
    )
    _, c0 = model.run_with_cache(PROMPTS[0], names_filter="blocks.1.mlp.hook_out")
    expected = c0["blocks.1.mlp.hook_out"][0, 2] * 0.5 + 1.0
    print(
        f"matches x*0.5+1 at position 2: {torch.allclose(c2['blocks.1.mlp.hook_out'][0, 2], expected)}"
    )

    _section("residual-stream analysis of prompt 0")
    one = cache.prompt(0)
    token = int(one["unembed.hook_out"][0, -1].argmax())
    parts, labels = one.decompose_resid(return_labels=True, pos_slice=-1)
    attrs = one.logit_attrs(parts, tokens=token, pos_slice=-1)
    print(f"predicted next token: {model.tokenizer.token_to_str(token)!r}")
    ranked = sorted(zip(labels, attrs.flatten().tolist(), strict=True), key=lambda p: -abs(p[1]))
    for label, value in ranked[:5]:
        print(f"  {label:12s} direct logit attribution {value:+.4f}")
    accumulated, acc_labels = one.accumulated_resid(return_labels=True, apply_ln=True, pos_slice=-1)
    print(f"accumulated residual stack {tuple(accumulated.shape)}: {', '.join(acc_labels)}")

    _section("generation with a steering vector")
    steer = torch.zeros(model.cfg.d_model)
    steer[0] = 8.0
    plain = model.generate("Once upon a time", max_new_tokens=12)
    steered = model.generate(
        "Once upon a time",
        max_new_tokens=12,
        intervene={"blocks.0.hook_out": {"op": "add", "value": steer.tolist()}},
    )
    print(f"plain:   {plain!r}")
    print(f"steered: {steered!r}")
    print("\n(random weights: the text is noise; the mechanics are the point)")
