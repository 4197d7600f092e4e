"""The architecture report's independent checks: transformers alone is the reference.

``independent_check`` compares a booted driver with a plain forward of its own model:
every ``blocks.{i}.hook_in`` with what the i-th decoder layer receives (a forward
pre-hook), the logits, and an ``add`` at ``blocks.1.hook_in`` with the same addition made by
a pre-hook on the second layer. ``weights_not_held`` compares the booted model's tensors with
the checkpoint as the class that wrote it loads it, and ``weights_a_causal_lm_drops`` finds the
weights transformers' causal-LM class would drop from a checkpoint (what a refusal of it must
name).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _tiny_checkpoints as tiny

__all__ = [
    "RTOL",
    "Checked",
    "image_check",
    "independent_check",
    "independent_signal_check",
    "names_every_module",
    "weights_a_causal_lm_drops",
    "weights_not_held",
]

#: Relative tolerance of the independent checks.
RTOL = 1e-4


def _difference(got: Any, want: Any, what: str) -> str | None:
    """``None`` when ``got`` matches ``want`` within ``RTOL``, else what differs."""
    import torch

    if not isinstance(got, torch.Tensor):
        return f"{what}: tl returned no tensor"
    if tuple(got.shape) != tuple(want.shape):
        return f"{what}: shape {tuple(got.shape)}, transformers {tuple(want.shape)}"
    got, want = got.detach().float(), want.detach().float()
    diff = float((got - want).abs().max())
    bound = RTOL * max(1.0, float(want.abs().max()))
    if not diff <= bound:  # also catches NaN
        return f"{what}: max abs diff {diff:.3g} > {bound:.3g}"
    return None


def _hidden_input(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    return args[0] if args else kwargs["hidden_states"]


@contextlib.contextmanager
def _layer_inputs(layers: Sequence[Any], seen: list[list[Any]]) -> Iterator[None]:
    """Record every hidden-states input of each layer (forward pre-hooks)."""
    handles = []
    for i, layer in enumerate(layers):

        def record(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], i: int = i) -> None:
            seen[i].append(_hidden_input(args, kwargs).detach().clone())

        handles.append(layer.register_forward_pre_hook(record, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _add_to_layer_input(layer: Any, vector: Any) -> Iterator[None]:
    """A forward pre-hook adding ``vector`` to ``layer``'s hidden-states input."""

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (args[0] + vector, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + vector}

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@dataclass(frozen=True)
class Checked:
    """What the independent checks found.

    Attributes:
        problems: What differs between tl and transformers (empty: tl is right).
        remarks: What the page should say about transformers' own outputs.
    """

    problems: tuple[str, ...]
    remarks: tuple[str, ...] = ()


def independent_check(driver: Any, ids: Any) -> Checked:
    """Compare tl on ``driver`` with transformers alone on ``driver.hf_model``.

    The reference for ``blocks.{i}.hook_in`` is what a plain forward passes to the i-th
    decoder layer (a forward pre-hook records it), which is ``hidden_states[i]`` in most
    models; where transformers' ``hidden_states`` follow another convention (Mamba's hold
    each layer's output) the page says so.
    """
    import torch

    from tl_core import TransformerBridge

    model = driver.hf_model
    layers = tiny.decoder_layers(model, ids)
    if layers is None:
        return Checked(
            (
                "no nn.ModuleList of the config's layer count runs: the decoder layers cannot be found",
            )
        )
    n_layers = len(layers)
    seen: list[list[Any]] = [[] for _ in range(n_layers)]
    with _layer_inputs(layers, seen):
        reference = tiny.run_transformers(model, ids)
    if any(len(calls) != 1 for calls in seen):
        counts = ", ".join(str(len(calls)) for calls in seen)
        return Checked((f"the decoder layers run {counts} times in one forward, not once each",))
    inputs = [calls[0] for calls in seen]
    remarks = []
    hidden = getattr(reference, "hidden_states", None)
    if (
        hidden is None
        or len(hidden) < n_layers
        or any(_difference(hidden[i], inputs[i], "") for i in range(n_layers))
    ):
        remarks.append("transformers' hidden_states[i] is not layer i's input")
    names = [f"blocks.{i}.hook_in" for i in range(n_layers)]
    missing = [n for n in names if n not in driver.hook_points]
    if missing:
        return Checked((f"not served: {', '.join(missing)}",), tuple(remarks))
    bridge = TransformerBridge(driver)
    problems: list[str] = []
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids, names_filter=names)
    for i, name in enumerate(names):
        problem = _difference(cache[name], inputs[i], f"{name} vs layer {i}'s input")
        if problem:
            problems.append(problem)
    problem = _difference(logits, reference.logits, "logits")
    if problem:
        problems.append(problem)
    vector = torch.randn(inputs[1].shape[-1], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        edited = bridge(ids, intervene={"blocks.1.hook_in": {"op": "add", "value": vector}})
        with _add_to_layer_input(layers[1], vector):
            want = tiny.run_transformers(model, ids).logits
    problem = _difference(edited, want, "logits with blocks.1.hook_in += v")
    if problem:
        problems.append(problem)
    return Checked(tuple(problems), tuple(remarks))


def _stack_layers(stack: Any) -> list[Any]:
    """A stack's block list, found without tl: its first ``nn.ModuleList`` child."""
    from torch import nn

    for _, child in stack.named_children():
        if isinstance(child, nn.ModuleList) and len(child):
            return list(child)
    return []


def independent_seq2seq_check(driver: Any, ids: Any, decoder_ids: Any) -> Checked:
    """Compare tl on an encoder-decoder with transformers alone.

    The references: what a plain forward passes to each block of each stack (forward
    pre-hooks on ``get_encoder()``'s and ``get_decoder()``'s block lists), the plain logits,
    and adds at block 1 of each stack made by a plain pre-hook.
    """
    import torch

    from tl_core import TransformerBridge

    model = driver.hf_model
    stacks = {
        "encoder_blocks": _stack_layers(model.get_encoder()),
        "decoder_blocks": _stack_layers(model.get_decoder()),
    }
    if not all(stacks.values()):
        return Checked(("no block list found in the encoder or the decoder",))
    seen = {prefix: [[] for _ in layers] for prefix, layers in stacks.items()}

    def plain() -> Any:
        with torch.no_grad():
            return model(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=False)

    with contextlib.ExitStack() as hooks:
        for prefix, layers in stacks.items():
            hooks.enter_context(_layer_inputs(layers, seen[prefix]))
        reference = plain()
    names = [f"{p}.{i}.hook_in" for p, layers in stacks.items() for i in range(len(layers))]
    missing = [n for n in names if n not in driver.hook_points]
    if missing:
        return Checked((f"not served: {', '.join(missing)}",))
    bridge = TransformerBridge(driver)
    problems: list[str] = []
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids, decoder_input=decoder_ids, names_filter=names)
    for prefix, calls in seen.items():
        for i, call in enumerate(calls):
            name = f"{prefix}.{i}.hook_in"
            if len(call) != 1:
                problems.append(f"{prefix} block {i} ran {len(call)} times in one forward")
                continue
            problem = _difference(cache[name], call[0], f"{name} vs that block's input")
            if problem:
                problems.append(problem)
    problem = _difference(logits, reference.logits, "logits")
    if problem:
        problems.append(problem)
    for prefix, layers in stacks.items():
        block = min(1, len(layers) - 1)
        width = seen[prefix][block][0].shape[-1]
        vector = torch.randn(width, generator=torch.Generator().manual_seed(2))
        name = f"{prefix}.{block}.hook_in"
        with torch.no_grad():
            edited = bridge(
                ids, decoder_input=decoder_ids, intervene={name: {"op": "add", "value": vector}}
            )
            with _add_to_layer_input(layers[block], vector):
                want = plain().logits
        problem = _difference(edited, want, f"logits with {name} += v")
        if problem:
            problems.append(problem)
    return Checked(tuple(problems))


def _signal_layers(model: Any, inputs: Mapping[str, Any]) -> list[Any]:
    """The block list of a pixel or audio model, found without tl: the ``nn.ModuleList`` of
    the config's layer count whose blocks each receive one ``[batch, pos, width]`` tensor."""
    import torch
    from torch import nn

    config = model.config
    holders = (
        config,
        *(getattr(config, n, None) for n in ("vision_config", "audio_config", "encoder_config")),
    )
    count = next(
        (h.num_hidden_layers for h in holders if getattr(h, "num_hidden_layers", None)),
        None,
    )
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == count]
    seen = [[[] for _ in layers] for layers in lists]
    with contextlib.ExitStack() as hooks:
        for layers, calls in zip(lists, seen, strict=True):
            hooks.enter_context(_layer_inputs(list(layers), calls))
        with torch.no_grad():
            model(**inputs)
    for layers, calls in zip(lists, seen, strict=True):
        if all(len(c) == 1 and c[0].ndim == 3 for c in calls):
            return list(layers)
    return []


def independent_signal_check(driver: Any, inputs: Mapping[str, Any]) -> Checked:
    """Compare tl on a model that reads pixels or audio with transformers alone: what a
    plain forward passes to each block (forward pre-hooks), the logits, and an add at
    ``blocks.1.hook_in`` made by a plain pre-hook."""
    import torch

    from tl_core import TransformerBridge

    model = driver.hf_model
    ((_, signal),) = inputs.items()
    layers = _signal_layers(model, inputs)
    if not layers:
        return Checked(("no block list of the config's layer count runs once per block",))
    seen: list[list[Any]] = [[] for _ in layers]
    with _layer_inputs(layers, seen), torch.no_grad():
        reference = model(**inputs)
    names = [f"blocks.{i}.hook_in" for i in range(len(layers))]
    missing = [n for n in names if n not in driver.hook_points]
    if missing:
        return Checked((f"not served: {', '.join(missing)}",))
    bridge = TransformerBridge(driver)
    problems: list[str] = []
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(signal, names_filter=names)
    for i, name in enumerate(names):
        problem = _difference(cache[name], seen[i][0], f"{name} vs layer {i}'s input")
        if problem:
            problems.append(problem)
    problem = _difference(logits, reference.logits, "logits")
    if problem:
        problems.append(problem)
    block = min(1, len(layers) - 1)
    vector = torch.randn(seen[block][0].shape[-1], generator=torch.Generator().manual_seed(2))
    name = f"blocks.{block}.hook_in"
    with torch.no_grad():
        edited = bridge(signal, intervene={name: {"op": "add", "value": vector}})
        with _add_to_layer_input(layers[block], vector):
            want = model(**inputs).logits
    problem = _difference(edited, want, f"logits with {name} += v")
    if problem:
        problems.append(problem)
    return Checked(tuple(problems))


def image_check(driver: Any, inputs: Mapping[str, Any]) -> tuple[bool, str | None]:
    """Whether tl gives the model its image, and what differs from transformers when it does.

    ``inputs`` is the recorded batch (``input_ids`` holding one image's tokens and
    ``pixel_values``, see ``_tiny_builds``): tl's logits with ``images=`` must be the plain
    model's on the same ids and pixels.

    Returns:
        ``(taken, problem)``: ``taken`` is whether the driver takes images; ``problem`` is
        ``None`` or what differs.
    """
    import _tiny_builds as builds
    import torch

    from tl_core import TransformerBridge

    if "pixel_values" not in inputs or not driver.supports("images"):
        return False, None
    tensors = builds.tensors(inputs)
    ids, pixels = tensors["input_ids"], tensors["pixel_values"]
    with torch.no_grad():
        want = driver.hf_model(input_ids=ids, pixel_values=pixels, use_cache=False).logits
        # tl takes images as [n, c, h, w] (a model's list of images per prompt flattened).
        got = TransformerBridge(driver)(ids, images=pixels.flatten(0, -4))
    return True, _difference(got, want, "logits with an image")


# -- the weights ----------------------------------------------------------------------------


def _fingerprints(model: Any) -> dict[tuple[Any, ...], list[str]]:
    """Each tensor of ``model``'s state (parameters and persistent buffers) by its shape,
    dtype and bytes, with the names holding it (tied weights share one entry)."""
    import torch

    found: dict[tuple[Any, ...], list[str]] = {}
    for name, tensor in model.state_dict().items():
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        key = (tuple(tensor.shape), str(tensor.dtype), hashlib.blake2b(data.tobytes()).digest())
        found.setdefault(key, []).append(name)
    return found


def _load_plain(auto_class: str, folder: Path) -> Any:
    import torch
    import transformers

    with tiny.quiet():
        return getattr(transformers, auto_class).from_pretrained(folder, dtype=torch.float32)


def weights_not_held(model: Any, folder: Path, auto_class: str) -> tuple[list[str], list[str]]:
    """The checkpoint's weights ``model`` does not hold, and ``model``'s weights that are not
    the checkpoint's (initialised, not loaded).

    The checkpoint's weights are those of the class that wrote it (``auto_class``), loaded
    by plain transformers; a weight is held when a tensor of ``model`` has the same shape,
    dtype and values (the builder jitters constant tensors, so no two weights are equal by
    chance).
    """
    reference = _fingerprints(_load_plain(auto_class, folder))
    held = _fingerprints(model)
    dropped = sorted(names[0] for key, names in reference.items() if key not in held)
    foreign = sorted(names[0] for key, names in held.items() if key not in reference)
    return dropped, foreign


def weights_a_causal_lm_drops(folder: Path, auto_class: str) -> list[str]:
    """The weights of a checkpoint (as ``auto_class`` loads it) that the class
    ``AutoModelForCausalLM`` builds from its config would not hold; empty when transformers
    builds no causal LM from it (nothing could boot)."""
    try:
        causal = _load_plain("AutoModelForCausalLM", folder)
    except Exception:  # no causal-LM class, or one transformers refuses to build
        return []
    dropped, _ = weights_not_held(causal, folder, auto_class)
    return dropped


def _module(name: str) -> str:
    """The module a weight belongs to, as a refusal names it: its first two parts
    (``model.encoder`` of ``model.encoder.layers.0.fc1.weight``), or the whole name."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else name


def names_every_module(message: str, weights: Sequence[str]) -> list[str]:
    """The modules of ``weights`` that ``message`` does not name."""
    return sorted({_module(w) for w in weights if _module(w) not in message})
