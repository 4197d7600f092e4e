"""Infer an architecture nobody described, from the config and the module tree.

One probe forward (a few token ids, no tl hooks) records when each module runs and what
it reads and returns. From that:

* the input and output embeddings come from transformers' own accessors;
* the decoder-layer list is the ``ModuleList`` whose children all run, once each, in index
  order, each mapping a ``[batch, pos, d_model]`` tensor to one;
* the final norm is the module that runs after the last layer and hands the unembedding
  its input;
* inside a layer, attention and the MLP are found by name and class, and each norm by what
  it touches: the norm whose output attention reads is ``ln1``, the one whose output the
  MLP reads is ``ln2``, one that reads attention's (or the MLP's) output is a sandwich
  norm; the MLP reading the block input makes the block parallel;
* each norm's weight rule is the one of tl's kinds that reproduces its output.

The facts found make an inferred ``FamilyDescription`` (the class hand-written families use),
and the paths an ``ArchitectureAdapter`` referring to it. What the probe proposes is only a
hypothesis: the driver serves a hook after certification (``tl_driver_hf._certification._certify``) has
proven it on the booted model. Layers of different shapes (hybrid models) or blocks whose
parts cannot be told apart keep the residual stream only; their norms, position scheme and
final norm are ``"unknown"`` unless a module tl measured establishes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal, cast

import torch
from torch import nn

from tl_core import ConfigError, ModelInfo
from tl_core.architecture import (
    UNKNOWN,
    FamilyDescription,
    MLPVariant,
    NormKind,
    PositionScheme,
    QKNorm,
    StackDescription,
    Unknown,
    uses_alibi,
)
from tl_core.driver_api import canonical_hook_names
from tl_driver_hf._architecture._kinds import MASKED_LM, class_kind
from tl_driver_hf._architecture._probe import ModuleCall, path_of, probe_ids, recording, same_tensor
from tl_driver_hf._runtime._norms import is_norm_module, norm_kind_of
from tl_driver_hf.adapters import ArchitectureAdapter

__all__ = ["InferredArchitecture", "infer_architecture"]

_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention", "attn_layer")
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "mlp_block", "feedforward")
_Q = ("q_proj", "query", "wq", "q")
_K = ("k_proj", "key", "wk", "k")
_V = ("v_proj", "value", "wv", "v")
_QKV = ("qkv_proj", "query_key_value", "Wqkv", "c_attn", "qkv", "W_pack", "wqkv")
_O = ("o_proj", "out_proj", "dense", "c_proj", "wo", "o", "out")
# Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3): (latent norm, up-projection).
_Q_LATENT = ("q_a_layernorm", "q_b_proj")
_KV_LATENT = ("kv_a_layernorm", "kv_b_proj")
_NORM_SUFFIXES = ("hook_in", "hook_scale", "hook_normalized", "hook_out")
_Q_NORM = ("q_norm", "q_layernorm", "query_layernorm", "q_ln")
_K_NORM = ("k_norm", "k_layernorm", "key_layernorm", "k_ln")
_GATE = ("gate_proj", "w1", "fc_gate")
_UP = ("up_proj", "w3")
_GATE_UP = ("gate_up_proj",)
_DOWN = ("down_proj", "w2", "fc2", "c_proj", "dense_4h_to_h", "fc_out", "out_proj", "proj_out")
_MLP_IN = ("fc1", "c_fc", "dense_h_to_4h", "fc_in", "up_proj", "proj_in")
_SHARED = ("shared_expert", "shared_experts", "shared_mlp")
_SHARED_GATE = ("shared_expert_gate",)


@dataclass(frozen=True)
class InferredArchitecture:
    """What inference found: an adapter to wire, its inferred description, and the facts
    behind it.

    Attributes:
        adapter: The adapter the driver wires (``verified`` false), whose ``description``
            is the inferred ``FamilyDescription`` (family ``"<model_type> (inferred)"``).
        facts: What the probe found, for the certification report.
        blocks: ``"sublayers"`` (attention and MLP found in every layer) or ``"opaque"``
            (the residual stream only).
        info: The model's ``ModelInfo``.
    """

    adapter: ArchitectureAdapter
    facts: Mapping[str, str]
    blocks: Literal["sublayers", "opaque"]
    info: ModelInfo


def _shared_expert(mlp: nn.Module) -> tuple[str, tuple[str, str, str], str | None, int] | None:
    """A mixture of experts' shared expert: ``(its name, its gate/up/down projections, the
    Linear gating its output or None, its hidden width)``, or ``None``."""
    children = dict(mlp.named_children())
    name = next((n for n in _SHARED if n in children), None)
    if name is None:
        return None
    parts = tuple(_child(children[name], names) for names in (_GATE, _UP, _DOWN))
    if not all(parts):
        return None  # not a gated MLP of the usual names: its sites are not served
    gate, up, down = cast(tuple[str, str, str], parts)
    weight = children[name].get_submodule(down).weight
    assert isinstance(weight, torch.Tensor)  # _child picked a module with a weight tensor
    width = int(weight.shape[-1])
    return name, (gate, up, down), _child(mlp, _SHARED_GATE), width


def _child(module: nn.Module, names: tuple[str, ...]) -> str | None:
    children = dict(module.named_children())
    for name in names:
        child = children.get(name)
        if child is not None and isinstance(getattr(child, "weight", None), torch.Tensor):
            return name
    return None


def _layer_list(
    model: nn.Module,
    calls: Mapping[int, ModuleCall],
    d_model: int,
    n_pos: int,
    n_layers: int | None,
) -> str:
    best: tuple[int, int, str] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        starts = []
        for child in module:
            call = calls.get(id(child))
            out = call.output if call is not None else None
            # Exactly [batch, pos, d_model]: parallel streams (Gemma 3n's AltUp) are no
            # single residual stream.
            if call is None or out is None or tuple(out.shape) != (1, n_pos, d_model):
                break
            starts.append(call.start)
        else:
            # The config's layer count, where it has one, picks the list: models with
            # several token-level lists (encoder and decoder stacks, recurrent loops) are
            # not one residual stream tl can name.
            if starts == sorted(starts) and (n_layers is None or len(module) == n_layers):
                key = (len(module), -name.count("."), name)
                if best is None or key[:2] > best[:2]:
                    best = key
    if best is None:
        count = f" {n_layers} (the config's layer count)" if n_layers is not None else ""
        raise ConfigError(
            f"cannot infer the decoder layers: no ModuleList of{count} children runs them in "
            f"order on [batch, pos, d_model] tensors; describe the family with an "
            f"ArchitectureAdapter (docs/adding-a-family.md)"
        )
    return best[2]


def _final_norm(
    model: nn.Module, layers: nn.ModuleList, lm_head: nn.Module, calls: Mapping[int, ModuleCall]
) -> tuple[str | None, bool]:
    """The final norm's path (``None``: none), and whether the unembedding reads something
    else than the last block's output through that one norm (a head transform)."""
    last = calls[id(layers[len(layers) - 1])]
    head = calls.get(id(lm_head))
    inside = {id(m) for m in layers.modules()}
    if head is None:
        raise ConfigError(
            "cannot infer the final norm: the unembedding never ran in the probe forward"
        )
    for name, module in model.named_modules():
        call = calls.get(id(module))
        if call is None or id(module) in inside or module is lm_head:
            continue
        between = call.start > last.end and call.end < head.start
        if (
            between
            and is_norm_module(module)
            and same_tensor(call.output, head.input)
            and same_tensor(call.input, last.output)
        ):
            return str(name), False
    if same_tensor(head.input, last.output):
        return None, False
    return None, True


@dataclass(frozen=True)
class _HeadTransform:
    """A masked LM's head transform: ``norm(act(dense(last block's output)))`` feeds the
    unembedding (paths in the model; ``act`` ``None`` where it is no module)."""

    dense: str
    act: str | None
    norm: str


def _head_transform(
    model: nn.Module, layers: nn.ModuleList, lm_head: nn.Module, calls: Mapping[int, ModuleCall]
) -> _HeadTransform | None:
    """BERT's ``cls.predictions.transform``, found by what its modules read and return: a
    Linear reading the last block's output, a norm handing the unembedding its input, and
    the activation between them where it is a module."""
    last, head = calls[id(layers[len(layers) - 1])], calls.get(id(lm_head))
    if head is None:
        return None
    inside = {id(m) for m in layers.modules()}
    between = [
        (str(name), module, call)
        for name, module in model.named_modules()
        if (call := calls.get(id(module))) is not None
        and id(module) not in inside
        and call.start > last.end
        and call.end < head.start
    ]
    dense = next(
        (
            e
            for e in between
            if isinstance(e[1], nn.Linear) and same_tensor(e[2].input, last.output)
        ),
        None,
    )
    norm = next(
        (e for e in between if is_norm_module(e[1]) and same_tensor(e[2].output, head.input)), None
    )
    if dense is None or norm is None or not dense[2].end <= norm[2].start:
        return None
    act = next(
        (
            name
            for name, module, call in between
            if module is not dense[1]
            and not list(module.children())
            and same_tensor(call.input, dense[2].output)
            and same_tensor(call.output, norm[2].input)
        ),
        None,
    )
    return _HeadTransform(dense[0], act, norm[0])


def _first_position(
    model: nn.Module, pos_embed: str | None, calls: Mapping[int, ModuleCall]
) -> int:
    """The position id the model gave the probe's first token (RoBERTa's start after its
    padding id; 0 for most), read from what its position table received."""
    if pos_embed is None:
        return 0
    call = calls.get(id(model.get_submodule(pos_embed)))
    if call is None or call.input is None or call.input.numel() == 0:
        return 0
    return int(call.input.flatten()[0])


def _id_tables(
    model: nn.Module, embed: nn.Module, layers: nn.ModuleList, calls: Mapping[int, ModuleCall]
) -> list[tuple[str, torch.Tensor]]:
    """Embedding tables other than the token embedding that run before the first layer on
    integer ids, with the ids each received."""
    first = calls[id(layers[0])]
    return [
        (str(name), call.input)
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
        and module is not embed
        and (call := calls.get(id(module))) is not None
        and call.start < first.start
        and call.input is not None
        and not call.input.dtype.is_floating_point
    ]


def _position_embedding(tables: list[tuple[str, torch.Tensor]]) -> str | None:
    """Of the id tables (``_id_tables``), the one that reads positions: learned positions."""
    return next((name for name, ids in tables if _counts_positions(ids)), None)


def _token_type_embedding(tables: list[tuple[str, torch.Tensor]]) -> str | None:
    """Of the id tables, the one named for token types (BERT's segment rows); certification
    checks that it joins the token embedding."""
    return next((name for name, _ in tables if "token_type" in name), None)


def _embedding_norm(
    model: nn.Module, layers: nn.ModuleList, calls: Mapping[int, ModuleCall]
) -> str | None:
    """A norm outside the layers whose output is the first layer's input: the embedding
    norm (BERT's sums word, position and token-type rows, then normalises them)."""
    first = calls[id(layers[0])]
    inside = {id(m) for m in layers.modules()}
    for name, module in model.named_modules():
        call = calls.get(id(module))
        weight = getattr(module, "weight", None)
        if (
            call is not None
            and id(module) not in inside
            and call.end < first.start
            and is_norm_module(module)
            # A norm's own weight vector: an embedding module whose class is named after
            # its norm (RobertaPreLayerNormEmbeddings) is no norm.
            and isinstance(weight, torch.Tensor)
            and weight.ndim == 1
            and same_tensor(call.output, first.input)
        ):
            return str(name)
    return None


def _counts_positions(ids: torch.Tensor) -> bool:
    """Whether integer inputs step by one along the sequence (positions, maybe offset),
    unlike token ids (Gemma 4's per-layer embeddings read those)."""
    if ids.ndim == 0 or ids.shape[-1] < 2:
        return False
    steps = ids[..., 1:] - ids[..., :-1]
    return bool((steps == 1).all())


@dataclass
class _Block:
    attn: str | None = None
    mlp: str | None = None
    ln1: str | None = None
    ln2: str | None = None
    ln1_post: str | None = None
    ln2_post: str | None = None
    parallel: bool = False
    kinds: dict[str, NormKind | None] = field(default_factory=dict)
    why: str = ""
    #: Post-LN (BERT): ``ln1``/``ln2`` normalise the residual sums; the projections below
    #: are paths inside the layer (the MLP is no module of its own).
    post_ln: bool = False
    core: str | None = None
    o: str | None = None
    mlp_in: str | None = None
    down: str | None = None


def _find_child(layer: nn.Module, names: tuple[str, ...], classes: tuple[str, ...]) -> str | None:
    found = [n for n, m in layer.named_children() if n in names]
    if not found:
        found = [
            n for n, m in layer.named_children() if any(c in type(m).__name__ for c in classes)
        ]
    return found[0] if len(found) == 1 else None


def _linears(
    root: nn.Module, calls: Mapping[int, ModuleCall], prefix: str = ""
) -> list[tuple[str, ModuleCall]]:
    """Every ``nn.Linear`` under ``root`` that ran, with its path (``prefix`` prepended)."""
    return [
        (prefix + name, calls[id(m)])
        for name, m in root.named_modules()
        if isinstance(m, nn.Linear) and id(m) in calls
    ]


def _sum_is(a: torch.Tensor | None, b: torch.Tensor | None, total: torch.Tensor | None) -> bool:
    """Whether ``a + b`` is ``total`` (up to the rounding of one addition)."""
    if a is None or b is None or total is None or a.shape != b.shape or a.shape != total.shape:
        return False
    return bool(torch.allclose(a + b, total, rtol=1e-5, atol=1e-6))


def _post_ln_block(layer: nn.Module, attn: str, calls: Mapping[int, ModuleCall]) -> _Block | None:
    """A post-LN block (BERT: ``h = ln1(x + attn(x)); out = ln2(h + mlp(h))``) found by what
    its modules read and return, or ``None``. The layer's output is a norm's (``ln2``); ``ln1``
    reads attention's output projection plus the block input (inside attention's module,
    as BERT's, or beside it, as DistilBERT's); the MLP's projections sit anywhere else in
    the layer."""
    layer_call, attn_module = calls.get(id(layer)), layer.get_submodule(attn)
    a = calls.get(id(attn_module))
    if layer_call is None or a is None or layer_call.input is None:
        return None
    x = layer_call.input
    norms = {
        name: (module, calls[id(module)])
        for name, module in layer.named_modules()
        if name and is_norm_module(module) and id(module) in calls
    }
    ln2 = next((n for n, (_, c) in norms.items() if same_tensor(c.output, layer_call.output)), None)
    inside = _linears(attn_module, calls, attn + ".")
    # The output projection: a Linear inside attention whose output plus the block input is
    # a norm's input (that norm is ln1).
    found = [
        (o, n)
        for o, c in inside
        for n, (_, norm) in norms.items()
        if n != ln2 and _sum_is(c.output, x, norm.input)
    ]
    if ln2 is None or len(found) != 1:
        return None
    o, ln1 = found[0]
    ln1_call, ln2_call = norms[ln1][1], norms[ln2][1]
    outside = [(n, c) for n, c in _linears(layer, calls) if not n.startswith(attn + ".")]
    mlp_in = next((n for n, c in outside if same_tensor(c.input, ln1_call.output)), None)
    down = next((n for n, c in outside if _sum_is(c.output, ln1_call.output, ln2_call.input)), None)
    readers = [n for n, c in inside if same_tensor(c.input, x)]  # q, k and v read the input
    core = readers[0].rsplit(".", 1)[0] if readers else None
    if mlp_in is None or down is None or core is None:
        return None
    if any(r.rsplit(".", 1)[0] != core for r in readers):
        return None
    block = _Block(attn=attn, mlp="", ln1=ln1, ln2=ln2, post_ln=True, o=o, mlp_in=mlp_in, down=down)
    block.core = core.removeprefix(attn + ".") if core != attn else None
    block.kinds = {name: norm_kind_of(*norms[name]) for name in (ln1, ln2)}
    return block


def _block(layer: nn.Module, calls: Mapping[int, ModuleCall]) -> _Block:
    block = _Block()
    attn = _find_child(layer, _ATTN_NAMES, ("Attention",))
    mlp = _find_child(layer, _MLP_NAMES, ("MLP", "MoE", "Moe", "FeedForward", "Experts"))
    if attn is not None:
        post_ln = _post_ln_block(layer, attn, calls)
        if post_ln is not None:
            return post_ln
    if attn is None or mlp is None:
        block.why = (
            f"no single attention ({attn}) and MLP ({mlp}) module among the layer's children"
        )
        return block
    layer_call = calls.get(id(layer))
    a, m = calls.get(id(getattr(layer, attn))), calls.get(id(getattr(layer, mlp)))
    if layer_call is None or a is None or m is None:
        block.why = "attention or MLP did not run in the probe forward"
        return block
    block.attn, block.mlp = attn, mlp
    for name, child in layer.named_children():
        if not is_norm_module(child):
            continue
        call = calls.get(id(child))
        if call is None:
            continue
        if block.ln1 is None and same_tensor(call.output, a.input):
            block.ln1 = name
        elif block.ln2 is None and same_tensor(call.output, m.input):
            block.ln2 = name
        elif block.ln1_post is None and same_tensor(call.input, a.output):
            block.ln1_post = name
        elif block.ln2_post is None and same_tensor(call.input, m.output):
            block.ln2_post = name
        else:
            continue
        block.kinds[name] = norm_kind_of(child, call)
    if block.ln2 is not None:
        norm_in = calls[id(getattr(layer, block.ln2))].input
        block.parallel = same_tensor(norm_in, layer_call.input)
    elif block.ln1 is not None:
        block.parallel = same_tensor(m.input, calls[id(getattr(layer, block.ln1))].output)
    else:
        block.parallel = same_tensor(m.input, layer_call.input)
    return block


def _signature(block: _Block) -> tuple[Any, ...]:
    return (
        block.attn,
        block.mlp,
        block.ln1,
        block.ln2,
        block.ln1_post,
        block.ln2_post,
        block.parallel,
        block.post_ln,
        block.core,
        block.o,
        block.mlp_in,
        block.down,
    )


def _same_classes(layers: nn.ModuleList, path: str) -> bool:
    return len({type(layer.get_submodule(path)).__name__ for layer in layers}) == 1


def _info(
    config: Any, model: nn.Module, n_layers: int, d_model: int, d_vocab: int,
    description: FamilyDescription, architecture: str,
) -> ModelInfo:  # fmt: skip
    """The model's ``ModelInfo``: the description's reading of the config, or of the sizes
    the module tree shows where the config does not name them."""
    text = config.get_text_config()
    try:
        info = description.model_info(text, architecture=architecture)
    except (ConfigError, AttributeError, TypeError, ValueError):
        heads = int(getattr(config, "num_attention_heads", None) or 1)
        sizes = SimpleNamespace(
            num_hidden_layers=n_layers,
            hidden_size=d_model,
            num_attention_heads=heads,
            head_dim=d_model // heads,
            intermediate_size=_width(getattr(config, "intermediate_size", None), 4 * d_model),
            vocab_size=d_vocab,
            max_position_embeddings=getattr(config, "max_position_embeddings", None),
        )
        info = description.model_info(sizes, architecture=architecture)
    # The module tree, not the config, decides the sizes that shape the hooks, and whether
    # a shared expert was found.
    return dataclasses.replace(
        info, n_layers=n_layers, d_model=d_model, d_vocab=d_vocab, d_shared_expert=None
    )


def _mixer_norm(layers: nn.ModuleList, calls: Mapping[int, ModuleCall], d_model: int) -> str | None:
    """The norm before each layer's ``mixer`` where every layer is a norm and a state-space
    mixer (Mamba, Mamba-2: ``x + mixer(norm(x))``), else ``None``. The block equation
    certifies the claim."""
    names: set[str] = set()
    for layer in layers:
        children = dict(layer.named_children())
        mixer = children.get("mixer")
        if mixer is None or id(mixer) not in calls:
            return None
        norms = [
            name for name, child in children.items()
            if child is not mixer and (c := calls.get(id(child))) is not None and c.start < calls[id(mixer)].start
            and c.output is not None and tuple(c.output.shape[-1:]) == (d_model,)
        ]  # fmt: skip
        if len(norms) != 1 or len(children) != 2:
            return None
        names.add(norms[0])
    return names.pop() if len(names) == 1 else None


def infer_architecture(model: nn.Module) -> InferredArchitecture:
    """Propose an adapter for a transformers causal or masked LM that no adapter describes.

    Args:
        model: The loaded model (float weights, on one device).

    Returns:
        The proposal; certification decides what is served.

    Raises:
        ConfigError: No embedding, unembedding, decoder-layer list or final norm could be
            found (the message says which), so not even the residual stream can be served.
    """
    config: Any = model.config
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
    if (
        embed is None
        or lm_head is None
        or not isinstance(getattr(embed, "weight", None), torch.Tensor)
    ):
        raise ConfigError(
            "cannot infer the architecture: the model has no input or output embedding module"
        )
    d_model = int(cast(torch.Tensor, embed.weight).shape[1])
    ids = probe_ids(int(cast(torch.Tensor, embed.weight).shape[0]))
    device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
    with recording(model) as calls, torch.no_grad():
        try:
            model(
                input_ids=ids.to(device),
                attention_mask=torch.ones_like(ids).to(device),
                use_cache=False,
            )
        except Exception as exc:  # transformers alone runs here (tl only records calls)
            raise ConfigError(
                f"transformers cannot run this {type(model).__name__} from token ids "
                f"({type(exc).__name__}: {exc}), so there is no model to describe; its config "
                f"sizes likely disagree with each other (head sizes, head counts, rotary "
                f"dimensions). Fix config.json (or hf_config_overrides) until "
                f"AutoModelForCausalLM runs it"
            ) from exc
    declared = getattr(config.get_text_config(), "num_hidden_layers", None)
    n_declared = declared if isinstance(declared, int) and not isinstance(declared, bool) else None
    layers_path = _layer_list(model, calls, d_model, ids.shape[1], n_declared)
    layers = cast(nn.ModuleList, model.get_submodule(layers_path))
    final_norm, readout_opaque = _final_norm(model, layers, lm_head, calls)
    # A masked LM's head transform ends in the final norm; the readout stays opaque (the
    # logit lens would have to run the transform).
    head = _head_transform(model, layers, lm_head, calls) if readout_opaque else None
    if head is not None:
        final_norm = head.norm
    embed_norm = _embedding_norm(model, layers, calls)
    # A masked LM's encoder attends both ways; certification checks the direction claimed.
    masked = class_kind(type(model).__name__) == MASKED_LM
    lm: dict[str, Any] = {
        "kind": "masked_lm" if masked else "causal_lm",
        "stacks": (StackDescription(attention="bidirectional" if masked else "causal"),),
        "norm_after_embed": embed_norm is not None,
    }
    embed_path, head_path = path_of(model, embed), path_of(model, lm_head)
    assert embed_path is not None and head_path is not None
    blocks = [_block(layer, calls) for layer in layers]
    first = blocks[0]
    uniform = all(_signature(b) == _signature(first) for b in blocks) and first.attn is not None
    if first.attn is not None and (first.ln1_post is None) != (first.ln2_post is None):
        first.why = (
            "a norm after only one sublayer, which the hook vocabulary does not name (it "
            "names one after each sublayer, or none)"
        )
        uniform = False
    model_type = str(getattr(config, "model_type", "unknown"))
    arch = str((getattr(config, "architectures", None) or [type(model).__name__])[0])
    text = config.get_text_config()
    rotary = any(
        getattr(text, k, None) is not None
        for k in ("rope_parameters", "rope_theta", "rotary_emb_base")
    )
    final_module = model.get_submodule(final_norm) if final_norm is not None else None
    final_kind = (
        norm_kind_of(final_module, calls.get(id(final_module)))
        if final_module is not None
        else None
    )
    embed_module = model.get_submodule(embed_norm) if embed_norm is not None else None
    embed_kind = (
        norm_kind_of(embed_module, calls.get(id(embed_module)))
        if embed_module is not None
        else None
    )
    kinds = {k for b in blocks for k in b.kinds.values()} | {final_kind}
    # The head transform's norm says nothing of the blocks' norms: theirs come first.
    known = [k for k in (*first.kinds.values(), final_kind) if k is not None]
    # A norm whose weight rule is not the one wired (or none of tl's) keeps its input and
    # output hooks; tl cannot recompute its scale and pre-weight value.
    absent: dict[str, str] = {}
    unknown = "tl cannot recompute this norm's scale and pre-weight value (its weight rule or epsilon is not one tl knows)"
    id_tables = _id_tables(model, embed, layers, calls)
    pos_embed = _position_embedding(id_tables)
    position_ids_start = _first_position(model, pos_embed, calls)
    token_type_embed = _token_type_embedding(id_tables)
    lm["token_types"] = token_type_embed is not None
    lm["head_transform"] = head is not None
    facts: dict[str, str] = {
        "embedding": embed_path + (f", then the norm {embed_norm}" if embed_norm else ""),
        "layers": f"{layers_path} ({len(layers)} x {type(layers[0]).__name__})",
        "unembedding": head_path,
    }
    norm: NormKind | Unknown | None
    if not uniform:
        why = first.why or "layers differ in structure (a hybrid of layer kinds)"
        mixer_norm = _mixer_norm(layers, calls, d_model)
        mixer_kind = None
        if mixer_norm is not None:
            module = layers[0].get_submodule(mixer_norm)
            mixer_kind = norm_kind_of(module, calls.get(id(module)))
        # The embedding norm's kind says nothing of the blocks' norms (BART's decoder).
        established = [k for k in (None if head else final_kind, mixer_kind) if k is not None]
        norm = established[0] if established else UNKNOWN
        if mixer_norm is not None and mixer_kind != norm:
            absent.update(
                {"blocks.{i}.ln1.hook_scale": unknown, "blocks.{i}.ln1.hook_normalized": unknown}
            )
        if final_norm is not None and final_kind != norm:
            absent.update({"ln_final.hook_scale": unknown, "ln_final.hook_normalized": unknown})
        if embed_norm is not None and embed_kind != norm:
            absent.update({"embed_ln.hook_scale": unknown, "embed_ln.hook_normalized": unknown})
        if final_norm is None:
            absent.update({f"ln_final.{s}": _no_final_norm(readout_opaque) for s in _NORM_SUFFIXES})
        facts["final norm"] = (
            f"{final_norm} ({final_kind or 'unknown weight rule'})"
            if final_norm
            else "unknown: " + ("a head transform before the unembedding" if readout_opaque
                                else "the unembedding reads the last block, which tl reads from outside")
        )  # fmt: skip
        facts["blocks"] = (
            f"state-space mixer: x + mixer(norm(x)), norm {mixer_norm!r}"
            if mixer_norm
            else f"opaque: {why}"
        )
        facts["positions"] = "learned (a position table)" if pos_embed else "unknown"
        description = FamilyDescription(
            family=f"{model_type} (inferred)", model_types=(model_type,), architectures=(arch,),
            norm=norm, norm_before_attn=False, norm_before_mlp=False,
            norm_before_unembed=True if final_norm is not None else UNKNOWN,
            positions="learned" if pos_embed else UNKNOWN, mlp_variant="dense",
            blocks="mixer" if mixer_norm else "opaque", inferred=True, **lm,
        )  # fmt: skip
        info = _info(config, model, len(layers), d_model, _rows(lm_head), description, arch)
        opaque = f"{model_type} blocks are read as a whole ({why}): tl serves their input and output only"
        kept = {"hook_in", "hook_out"} | (
            {"mixer.hook_in", "mixer.hook_out"} | {f"ln1.{s}" for s in _NORM_SUFFIXES}
            if mixer_norm
            else set()
        )
        for name in canonical_hook_names(
            info, include_split_qkv_input=True, include_attn_result=True
        ):
            if name.startswith("blocks.0.") and name.removeprefix("blocks.0.") not in kept:
                absent.setdefault(name.replace("blocks.0.", "blocks.{i}.", 1), opaque)
        adapter = ArchitectureAdapter(
            description=description, embed=embed_path,
            layers=layers_path, final_norm=final_norm, lm_head=head_path, ln1=mixer_norm, ln2=None,
            attn="", q=None, k=None, v=None, o="", mlp="", gate=None, up=None, down=None,
            mixer="mixer" if mixer_norm else None,
            verified=False, pos_embed=pos_embed, embed_norm=embed_norm, token_type_embed=token_type_embed,
            head_dense=head.dense if head else None, head_act=head.act if head else None, absent=absent,
            readout_opaque=readout_opaque, position_ids_start=position_ids_start,
        )  # fmt: skip
        return InferredArchitecture(adapter, facts, "opaque", info)
    norm_found = any(p is not None for p in (first.ln1, first.ln2, first.ln1_post, first.ln2_post))
    if known:
        norm = known[0]
    elif norm_found or final_norm is not None or readout_opaque:
        norm = UNKNOWN  # norms whose weight rule tl could not measure
    else:
        norm = None  # attention and the MLP read the residual stream, the head the last block
    prefixes = {
        "ln1": first.ln1,
        "ln2": first.ln2,
        "ln1_post": first.ln1_post,
        "ln2_post": first.ln2_post,
    }
    for key, child in prefixes.items():
        if child is not None and any(b.kinds.get(child) != norm for b in blocks):
            absent.update(
                {
                    f"blocks.{{i}}.{key}.hook_scale": unknown,
                    f"blocks.{{i}}.{key}.hook_normalized": unknown,
                }
            )
    if final_norm is None:
        absent.update({f"ln_final.{s}": _no_final_norm(readout_opaque) for s in _NORM_SUFFIXES})
    elif final_kind != norm:
        absent.update({"ln_final.hook_scale": unknown, "ln_final.hook_normalized": unknown})
    if embed_norm is not None and embed_kind != norm:
        absent.update({"embed_ln.hook_scale": unknown, "embed_ln.hook_normalized": unknown})
    facts["final norm"] = (
        f"{final_norm} ({final_kind or 'unknown weight rule'})"
        if final_norm
        else "none: "
        + (
            "a head transform before the unembedding"
            if readout_opaque
            else "the unembedding reads the last block"
        )
    )
    layer0 = layers[0]
    attn_module = layer0.get_submodule(cast(str, first.attn))
    mlp_module = layer0.get_submodule(cast(str, first.mlp))
    if not _same_classes(layers, cast(str, first.attn)):
        attn_module = nn.Module()  # attention differs across layers: no projection sites
    # Post-LN attention (BERT) keeps q/k/v in a core module beside its output projection.
    core = attn_module.get_submodule(first.core) if first.core else attn_module
    q, k, v = _child(core, _Q), _child(core, _K), _child(core, _V)
    qkv = None if q and k and v else _child(core, _QKV)
    if qkv is None and not (q and k and v):
        q = k = v = None
    if first.core:
        q, k, v, qkv = (f"{first.core}.{p}" if p else None for p in (q, k, v, qkv))
    o = first.o.removeprefix(f"{first.attn}.") if first.o else _child(attn_module, _O)
    q_norm, k_norm = _child(attn_module, _Q_NORM), _child(attn_module, _K_NORM)
    latents = {
        key: (latent, proj)
        if _child(attn_module, (latent,)) and _child(attn_module, (proj,))
        else (None, None)
        for key, (latent, proj) in (("q", _Q_LATENT), ("kv", _KV_LATENT))
    }
    for key, child in (("q_norm", q_norm), ("k_norm", k_norm)):
        if (
            child is not None
            and norm_kind_of(
                attn_module.get_submodule(child), calls.get(id(attn_module.get_submodule(child)))
            )
            != norm
        ):
            absent.update(
                {
                    f"blocks.{{i}}.attn.{key}.hook_scale": unknown,
                    f"blocks.{{i}}.attn.{key}.hook_normalized": unknown,
                }
            )
    layout: Literal["positions_first", "heads_first", "flat"] = "positions_first"
    if q_norm is not None:
        call = calls.get(id(attn_module.get_submodule(q_norm)))
        shape = tuple(call.input.shape) if call is not None and call.input is not None else ()
        if len(shape) == 3:
            layout = "flat"
        elif len(shape) == 4 and shape[1] != ids.shape[1]:
            layout = "heads_first"
    # Dense layers before mixture-of-experts ones (DeepSeek, AFMoE): no per-neuron sites.
    moe = "experts" in dict(mlp_module.named_children()) or not _same_classes(
        layers, cast(str, first.mlp)
    )
    gate = up = down = gate_up = mlp_in = router = None
    shared: tuple[str, tuple[str, str, str], str | None, int] | None = None
    if first.post_ln:
        mlp_in, down = first.mlp_in, first.down
    elif not moe:
        gate_up = _child(mlp_module, _GATE_UP)
        gate = None if gate_up else _child(mlp_module, _GATE)
        up = _child(mlp_module, _UP) if gate else None
        down = _child(mlp_module, _DOWN)
        mlp_in = None if (gate or gate_up) else _child(mlp_module, _MLP_IN)
    else:
        router = next(
            (
                n
                for n, m in mlp_module.named_children()
                if (c := calls.get(id(m))) is not None and c.routes
            ),
            None,
        )
        if router is None or not _same_classes(layers, cast(str, first.mlp)):
            for suffix in ("hook_router_logits", "hook_expert_weights", "hook_expert_indices"):
                absent[f"blocks.{{i}}.mlp.{suffix}"] = (
                    "no module of this mixture of experts returns (logits, weights, indices) "
                    "as a router; describe the family to serve routing sites"
                )
        elif "experts" in dict(mlp_module.named_children()):
            shared = _shared_expert(mlp_module)
            if shared is not None and shared[2] is None:
                absent["blocks.{i}.mlp.shared_expert.hook_gate"] = (
                    "this model's shared expert has no gate"
                )
    conv1d = any(type(m).__name__ == "Conv1D" for m in attn_module.children())
    attn_call = calls.get(id(attn_module))
    rotary_in_attention = attn_call is not None and "position_embeddings" in attn_call.kwargs
    softcap = getattr(text, "attn_logit_softcapping", None)
    final_softcap = getattr(text, "final_logit_softcapping", None)
    # Gemma-style embeddings multiply their lookup by a buffer of their own.
    embed_scaled = isinstance(
        getattr(model.get_submodule(embed_path), "embed_scale", None), torch.Tensor
    )
    qk_norm: QKNorm = "none"
    if q_norm is not None:
        qk_norm = "across_heads" if layout == "flat" else "per_head"
    # A position table tl could not read (BART's takes the token ids and offsets its own
    # positions): the scheme is not established, so it is not called "none".
    unread_positions = pos_embed is None and any("pos" in name for name, _ in id_tables)
    positions: PositionScheme = (
        "learned" if pos_embed
        else "rotary" if rotary
        else UNKNOWN if unread_positions
        else "alibi" if uses_alibi(text)
        else "none"
    )  # fmt: skip
    mlp_variant: MLPVariant = "moe" if moe else "gated" if (gate or gate_up) else "dense"
    description = FamilyDescription(
        family=f"{model_type} (inferred)",
        model_types=(model_type,),
        architectures=(arch,),
        norm=norm,
        norm_before_attn=first.ln1 is not None and not first.post_ln,
        norm_before_mlp=first.ln2 is not None and not first.post_ln,
        norm_after_attn=first.ln1_post is not None,
        norm_after_mlp=first.ln2_post is not None,
        norm_after_residual=first.post_ln,
        norm_before_unembed=True
        if final_norm is not None
        else UNKNOWN
        if readout_opaque
        else False,
        parallel=first.parallel,
        positions=positions,
        embed_scaled=embed_scaled,
        qk_norm=qk_norm,
        mlp_variant=mlp_variant,
        sinks=isinstance(getattr(attn_module, "sinks", None), torch.Tensor),
        attn_softcap="attn_logit_softcapping" if softcap is not None else None,
        final_softcap="final_logit_softcapping" if final_softcap is not None else None,
        inferred=True,
        **lm,
    )
    adapter = ArchitectureAdapter(
        description=description,
        embed=embed_path,
        layers=layers_path,
        final_norm=final_norm,
        lm_head=head_path,
        ln1=first.ln1,
        ln2=first.ln2,
        ln1_post=first.ln1_post,
        ln2_post=first.ln2_post,
        attn=cast(str, first.attn),
        attention_core=first.core,
        q=q,
        k=k,
        v=v,
        qkv=qkv,
        o=o or "",
        q_norm=q_norm,
        k_norm=k_norm,
        qk_norm_layout=layout,
        q_latent=latents["q"][0],
        q_up=latents["q"][1],
        kv_latent=latents["kv"][0],
        kv_up=latents["kv"][1],
        mlp=cast(str, first.mlp),
        mlp_in=mlp_in,
        gate=gate,
        up=up,
        gate_up=gate_up,
        down=down,
        linear="conv1d" if conv1d else "linear",
        router=router,
        experts="experts" if shared else None,
        shared_expert=shared[0] if shared else None,
        shared_parts=shared[1] if shared else None,
        shared_expert_gate=shared[2] if shared else None,
        rotary_in_attention=rotary_in_attention,
        # Post-LN: the sublayers' outputs are their projections' (their modules go on to
        # add the residual and normalise), and the MLP is no module of its own.
        sublayers_add_residual=first.post_ln,
        mlp_inline=first.post_ln,
        verified=False,
        pos_embed=pos_embed,
        embed_norm=embed_norm,
        token_type_embed=token_type_embed,
        head_dense=head.dense if head else None,
        head_act=head.act if head else None,
        absent=absent,
        readout_opaque=readout_opaque,
        position_ids_start=position_ids_start,
    )
    form = "post-LN" if first.post_ln else "parallel" if first.parallel else "sequential"
    if description.sandwich:
        form += " with sandwich norms"
    facts["blocks"] = (
        f"{form}: attention {first.attn!r}, MLP {first.mlp!r}"
        + (" (mixture of experts)" if moe else "")
        + f", norms ln1={first.ln1} ln2={first.ln2} post={first.ln1_post}/{first.ln2_post}"
        + f" ({norm if len(kinds) == 1 and None not in kinds else 'weight rules differ or unknown'})"
    )
    facts["attention"] = (
        f"q/k/v {'fused ' + repr(qkv) if qkv else (q, k, v)}, out {o!r}, "
        f"{'rotary' if rotary else 'no rotary'}, qk-norm {q_norm is not None}"
    )
    facts["mlp"] = (
        f"experts (per-neuron sites absent){f', shared expert {shared[0]!r}' if shared else ''}" if moe
        else f"gate={gate} up={up} gate_up={gate_up} in={mlp_in} down={down}"
    )  # fmt: skip
    info = _info(config, model, len(layers), d_model, _rows(lm_head), description, arch)
    if shared is not None:
        info = dataclasses.replace(info, d_shared_expert=shared[3])
    return InferredArchitecture(adapter, facts, "sublayers", info)


def _no_final_norm(readout_opaque: bool) -> str:
    """Why an architecture with no final norm module has no ``ln_final`` sites."""
    if readout_opaque:
        return (
            "the unembedding reads a head transform (or a norm computed without a module), "
            "not one final norm"
        )
    return "the unembedding reads the last block's output directly"


def _width(value: Any, default: int) -> int:
    """A size that may be given per layer (a list, Gemma 3n): the first layer's."""
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    return int(value) if isinstance(value, (int, float)) and value else default


def _rows(lm_head: nn.Module) -> int:
    weight = getattr(lm_head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    return int(getattr(lm_head, "out_features", 0))
