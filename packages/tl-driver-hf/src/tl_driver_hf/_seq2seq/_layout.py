"""Where each canonical site of an encoder-decoder sits among transformers' modules.

An encoder-decoder's blocks are found by what they hold, not by family: T5's blocks keep
their sublayers in a ``layer`` list (``T5LayerSelfAttention``, ``T5LayerCrossAttention``,
``T5LayerFF``), BART's and its descendants' (mBART, Marian, Pegasus, M2M100, ...) hold
``self_attn``, ``encoder_attn``, ``fc1``/``fc2`` and a norm per sublayer. Each site is
one module's input or output (``Site``). As in TransformerLens, ``ln1`` is the norm of
self-attention, ``ln2`` that of cross-attention on a decoder block (the MLP's on an encoder
block) and ``ln3`` the MLP's on a decoder block, whether it sits before its sublayer
(pre-LN: T5, mBART) or after the residual add (post-LN: BART, Marian).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tl_core import ConfigError
from tl_driver_hf._runtime._whole_model import Site

__all__ = ["Site", "StackLayout", "find_stacks"]


@dataclass(frozen=True)
class StackLayout:
    """One stack's blocks and the sites of each, by canonical suffix (``attn.hook_z``)."""

    prefix: str
    blocks: tuple[nn.Module, ...]
    sites: tuple[dict[str, Site], ...]
    #: Sites read at a norm's input, where the norm takes the stream between two sublayers
    #: (BART-style blocks). On a pre-LN block that stream is a local variable of the
    #: block's forward, so such a site shows the value but cannot carry an edit of it.
    at_norm_input: frozenset[str]


def _layers(stack: nn.Module, where: str) -> tuple[nn.Module, ...]:
    for name in ("block", "layers"):
        found = getattr(stack, name, None)
        if isinstance(found, nn.ModuleList) and len(found):
            return tuple(found)
    raise ConfigError(
        f"tl found no list of blocks in the {where} ({type(stack).__name__}): it knows "
        "encoder-decoders whose stacks keep their blocks in `block` (T5) or `layers` (BART "
        "and its descendants)"
    )


def _attention(attn: nn.Module, prefix: str) -> dict[str, Site]:
    names = next(
        (n for n in (("q", "k", "v", "o"), ("q_proj", "k_proj", "v_proj", "out_proj")) if
         all(isinstance(getattr(attn, p, None), nn.Linear) for p in n)),
        None,
    )  # fmt: skip
    sites = {
        f"{prefix}.hook_in": Site(attn, "in"),
        f"{prefix}.hook_pattern": Site(attn, "weights"),
        f"{prefix}.hook_out": Site(attn, "out"),
    }
    if names is None:
        return sites
    q, k, v, o = (getattr(attn, n) for n in names)
    sites.update(
        {
            f"{prefix}.hook_q": Site(q, "heads_out"),
            f"{prefix}.hook_k": Site(k, "heads_out"),
            f"{prefix}.hook_v": Site(v, "heads_out"),
            f"{prefix}.hook_z": Site(o, "heads_in"),
        }
    )
    return sites


def _norm(module: nn.Module, prefix: str) -> dict[str, Site]:
    return {f"{prefix}.hook_in": Site(module, "in"), f"{prefix}.hook_out": Site(module, "out")}


#: The MLP inside a T5 feed-forward sublayer: T5's dense one, or Switch Transformers' (a
#: dense one or a mixture of experts, alternating by block).
_T5_MLP = ("DenseReluDense", "mlp")


def _t5_mlp(ff: Any) -> dict[str, Site]:
    dense = next(getattr(ff, n) for n in _T5_MLP if hasattr(ff, n))
    sites = {"mlp.hook_in": Site(dense, "in"), "mlp.hook_out": Site(dense, "out")}
    if not isinstance(getattr(dense, "wo", None), nn.Linear):
        # A mixture of experts: its input and output only (no one neuron axis).
        return sites
    if isinstance(getattr(dense, "wi", None), nn.Linear):
        sites["mlp.hook_pre"] = Site(dense.wi, "out")
    elif isinstance(getattr(dense, "wi_0", None), nn.Linear):
        sites["mlp.hook_pre"] = Site(dense.wi_0, "out")
        sites["mlp.hook_pre_linear"] = Site(dense.wi_1, "out")
    sites["mlp.hook_post"] = Site(dense.wo, "in")
    return sites


#: The self-attention of a T5 block's first sublayer, by the name each variant gives it.
_T5_SELF_ATTENTION = ("SelfAttention", "LocalSelfAttention", "TransientGlobalSelfAttention")


def _t5_block(block: Any, decoder: bool, where: str) -> dict[str, Site]:
    parts = list(block.layer)
    attn_layer, ff_layer = parts[0], parts[-1]
    attention = next(
        (getattr(attn_layer, n) for n in _T5_SELF_ATTENTION if hasattr(attn_layer, n)), None
    )
    if attention is None or not any(hasattr(ff_layer, n) for n in _T5_MLP):
        raise ConfigError(
            f"tl does not know the blocks of the {where} ({type(block).__name__}): a T5-style "
            f"block whose sublayers ({', '.join(type(p).__name__ for p in parts)}) hold no "
            "self-attention or no MLP (DenseReluDense, or Switch Transformers' mlp) it knows"
        )
    sites = {"hook_in": Site(block, "in")}
    sites.update(_norm(attn_layer.layer_norm, "ln1"))
    sites.update(_attention(attention, "attn"))
    # Each T5 sublayer adds its own output to its input: the module after it reads the
    # residual stream, so an edit of its input is an edit of the stream.
    sites["ln2.hook_in"] = Site(parts[1], "in")
    if decoder:
        cross = parts[1]
        sites["ln2.hook_out"] = Site(cross.layer_norm, "out")
        sites.update(_attention(cross.EncDecAttention, "cross_attn"))
        sites["ln3.hook_in"] = Site(ff_layer, "in")
        sites["ln3.hook_out"] = Site(ff_layer.layer_norm, "out")
    else:
        sites["ln2.hook_out"] = Site(ff_layer.layer_norm, "out")
    sites.update(_t5_mlp(ff_layer))
    sites["hook_out"] = Site(block, "out")
    return sites


#: A BART-style block's parts, each by the names its families give it: BART and its
#: descendants (``encoder_attn``, ``fc1``/``fc2`` on the block, ``final_layer_norm``),
#: NLLB-MoE and SeamlessM4T (``cross_attention``, an ``ffn`` module, ``ff_layer_norm``).
_BART_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn": ("self_attn",),
    "ln1": ("self_attn_layer_norm",),
    "cross_attn": ("encoder_attn", "cross_attention"),
    "ln_cross": ("encoder_attn_layer_norm", "cross_attention_layer_norm"),
    "ln_mlp": ("final_layer_norm", "ff_layer_norm", "ffn_layer_norm"),
}


def _part(block: nn.Module, role: str) -> nn.Module | None:
    found = (getattr(block, n, None) for n in _BART_PARTS[role])
    return next((m for m in found if isinstance(m, nn.Module)), None)


def _bart_mlp(block: Any) -> dict[str, Site] | None:
    """The MLP's sites: ``fc1``/``fc2`` on the block (BART), or an ``ffn`` module (dense,
    with ``fc1``/``fc2`` inside; or a mixture of experts: its input and output only)."""
    ffn = getattr(block, "ffn", None)
    holder = ffn if isinstance(ffn, nn.Module) else block
    fc1, fc2 = getattr(holder, "fc1", None), getattr(holder, "fc2", None)
    # The MLP's input and output: the ffn module's, else fc1's input and fc2's output.
    first, last = (holder, holder) if holder is not block else (fc1, fc2)
    if not isinstance(first, nn.Module) or not isinstance(last, nn.Module):
        return None
    sites = {"mlp.hook_in": Site(first, "in")}
    if isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear):
        sites.update({"mlp.hook_pre": Site(fc1, "out"), "mlp.hook_post": Site(fc2, "in")})
    sites["mlp.hook_out"] = Site(last, "out")
    return sites


def _bart_block(block: Any, decoder: bool) -> dict[str, Site] | None:
    """A BART-style block's sites, or ``None`` when it lacks a part (see ``_BART_PARTS``)."""
    roles = ["self_attn", "ln1", "ln_mlp", *(["cross_attn", "ln_cross"] if decoder else [])]
    found = {role: _part(block, role) for role in roles}
    parts = {role: m for role, m in found.items() if m is not None}
    mlp = _bart_mlp(block)
    if mlp is None or len(parts) < len(roles):
        return None
    sites = {"hook_in": Site(block, "in")}
    sites.update(_norm(parts["ln1"], "ln1"))
    sites.update(_attention(parts["self_attn"], "attn"))
    if decoder:
        sites.update(_norm(parts["ln_cross"], "ln2"))
        sites.update(_attention(parts["cross_attn"], "cross_attn"))
        sites.update(_norm(parts["ln_mlp"], "ln3"))
    else:
        sites.update(_norm(parts["ln_mlp"], "ln2"))
    sites.update(mlp)
    sites["hook_out"] = Site(block, "out")
    return sites


def _block_sites(block: nn.Module, decoder: bool, where: str) -> dict[str, Site]:
    if isinstance(getattr(block, "layer", None), nn.ModuleList):
        return _t5_block(block, decoder, where)
    sites = _bart_block(block, decoder)
    if sites is not None:
        return sites
    raise ConfigError(
        f"tl does not know the blocks of the {where} ({type(block).__name__}): it serves "
        "encoder-decoders built like T5 (a `layer` list of sublayers) or like BART "
        "(`self_attn`, cross-attention, an MLP (`fc1`/`fc2` or `ffn`) and a norm per "
        "sublayer)"
    )


def find_stacks(model: nn.Module) -> tuple[StackLayout, StackLayout]:
    """The encoder's and the decoder's blocks and sites.

    Args:
        model: A transformers encoder-decoder (``get_encoder``/``get_decoder``).

    Raises:
        ConfigError: Stacks or blocks of a form tl does not know (named).
    """
    if not callable(getattr(model, "get_encoder", None)) or not callable(
        getattr(model, "get_decoder", None)
    ):
        raise ConfigError(
            f"{type(model).__name__} gives no encoder and decoder stack (get_encoder and "
            "get_decoder): tl serves encoder-decoders whose two stacks it can find"
        )
    found: list[StackLayout] = []
    for prefix, getter, decoder in (
        ("encoder_blocks", "get_encoder", False),
        ("decoder_blocks", "get_decoder", True),
    ):
        stack = getattr(model, getter)()
        where = "decoder" if decoder else "encoder"
        blocks = _layers(stack, where)
        sites = tuple(_block_sites(b, decoder, where) for b in blocks)
        # T5's sublayers are modules whose input is the stream itself.
        t5_style = isinstance(getattr(blocks[0], "layer", None), nn.ModuleList)
        at_norm = frozenset() if t5_style else frozenset({"ln2.hook_in", "ln3.hook_in"})
        found.append(StackLayout(prefix, blocks, sites, at_norm))
    return found[0], found[1]


def final_norm(model: nn.Module) -> nn.Module | None:
    """The decoder's norm after its last block (T5's ``final_layer_norm``, mBART's
    ``layer_norm``), or ``None`` (BART has none)."""
    decoder: Any = model.get_decoder()  # type: ignore[operator]
    for name in ("final_layer_norm", "layer_norm"):
        module = getattr(decoder, name, None)
        if isinstance(module, nn.Module):
            return module
    return None
