"""The equations of certification: what holds for any transformer over canonical hooks.

``equation_checks`` takes one capture of canonical hooks (a few token ids, one sequence)
and checks, in forward order, the residual chain, each block's equation in its
sequential, parallel or sandwich form, norms, attention (pattern, values, scores, rotary,
output projection, sinks), the MLP's activation and a router's top-k, plus the engine's
own logits and hidden states when given. Pure tensor arithmetic: any driver can use it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from tl_core.certification._attention_equations import attention_checks
from tl_core.certification._report import CertificationCheck, compare
from tl_core.hooks._vocabulary import STACK_PREFIXES

if TYPE_CHECKING:
    import torch

    from tl_core.hooks._model_info import ModelInfo

__all__ = ["equation_checks", "stacked_equation_checks"]


#: Activations whose name in a model config tl can evaluate (``act_fn`` of ``ModelInfo``).
def _activation(name: str | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    import torch.nn.functional as F

    table: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "silu": F.silu,
        "swish": F.silu,
        "relu": F.relu,
        "gelu": F.gelu,
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    }
    return table.get(name or "")


def equation_checks(
    cache: Mapping[str, torch.Tensor],
    info: ModelInfo,
    *,
    rtol: float = 1e-4,
    hidden_states: Iterable[torch.Tensor] | None = None,
    logits: torch.Tensor | None = None,
    reference_logits: torch.Tensor | None = None,
    W_O: torch.Tensor | None = None,
    b_O: torch.Tensor | None = None,
    attn_softcap: float | None = None,
    score_bias: bool = False,
    attention_sinks: bool = False,
) -> list[CertificationCheck]:
    """The engine-independent equations over a capture of canonical hooks.

    Only equations whose hooks the model's structure has are checked; a hook the structure
    has but the capture lacks fails its equations (it never fired).

    Args:
        cache: Canonical name -> captured tensor (one forward of a few token ids, one
            sequence, no padding).
        info: The model's structure (parallel, sandwich norms, norm type, gated MLP).
        rtol: Relative tolerance of every comparison.
        hidden_states: The engine's own residual stream, one tensor per block input
            (``hidden_states[i]`` of transformers), to vouch for ``blocks.i.hook_in``.
        logits: The driver's logits for the same forward.
        reference_logits: The engine's own logits without tl, to vouch for the whole run.
        W_O: ``[n_layers, n_heads, d_head, d_model]``: then ``attn.hook_out`` is checked
            as ``z`` through ``W_O`` (plus ``b_O``).
        b_O: ``[n_layers, d_model]`` or ``None``.
        attn_softcap: Attention-logit soft-cap of the model, if any.
        score_bias: Whether the scores hold an additive position bias (ALiBi): then they
            are not checked against ``q . k``.
        attention_sinks: Whether attention has sink logits (gpt-oss) that take softmax mass
            and no value: each pattern row then sums to at most 1, and is the softmax of
            its scores scaled by that sum.

    Returns:
        The checks, in forward order.
    """
    checks: list[CertificationCheck] = []
    names = set(cache)

    def get(name: str) -> torch.Tensor | None:
        return cache.get(name)

    def has(name: str) -> bool:
        return name in names

    def check(
        equation: str,
        hooks: Iterable[str],
        got: torch.Tensor | None,
        want: torch.Tensor | None,
        **kw: object,
    ) -> None:
        checks.append(compare(equation, hooks, got, want, rtol=rtol, **kw))  # type: ignore[arg-type]

    n = info.n_layers
    if logits is not None and reference_logits is not None:
        check("logits == the engine's own logits", ("unembed.hook_out",), logits, reference_logits)
    hidden = list(hidden_states or ())[:n]
    by_input = [
        compare(
            f"blocks.{i}.hook_in == the engine's hidden_states[{i}]",
            (f"blocks.{i}.hook_in",),
            get(f"blocks.{i}.hook_in"),
            h,
            rtol=rtol,
        )
        for i, h in enumerate(hidden)
    ]
    # Some families (Mamba) report each block's output where others report its input.
    by_output = [
        compare(
            f"blocks.{i}.hook_out == the engine's hidden_states[{i}] (it reports block outputs)",
            (f"blocks.{i}.hook_out",),
            get(f"blocks.{i}.hook_out"),
            h,
            rtol=rtol,
        )
        for i, h in enumerate(hidden[: n - 1])
    ]
    if not all(c.passed for c in by_input) and by_output and all(c.passed for c in by_output):
        checks.extend(by_output)
    else:
        checks.extend(by_input)
    if has("embed.hook_out") and not has("pos_embed.hook_out") and not has("embed_ln.hook_out"):
        check(
            "embed.hook_out == blocks.0.hook_in",
            ("embed.hook_out",),
            get("embed.hook_out"),
            get("blocks.0.hook_in"),
        )
    elif has("embed.hook_out") and has("pos_embed.hook_out") and not has("embed_ln.hook_out"):
        embed, pos = get("embed.hook_out"), get("pos_embed.hook_out")
        same = embed is not None and pos is not None and embed.shape == pos.shape
        summed = embed.double() + pos.double() if same else None  # type: ignore[union-attr]
        check(
            "embed.hook_out + pos_embed.hook_out == blocks.0.hook_in",
            ("embed.hook_out", "pos_embed.hook_out"),
            summed,
            get("blocks.0.hook_in"),
        )
    positions_known = info.positional_embedding_type != "unknown"
    if has("embed_ln.hook_in") and has("embed.hook_out") and positions_known:
        # BERT sums word, position and token-type rows, then normalises the sum (a position
        # scheme tl did not establish may add a term it does not see).
        terms = [
            t
            for t in ("embed.hook_out", "pos_embed.hook_out", "token_type_embed.hook_out")
            if has(t)
        ]
        parts = [get(t) for t in terms]
        shapes = {tuple(p.shape) for p in parts if p is not None}
        total = (
            sum((p.double() for p in parts[1:]), parts[0].double())  # type: ignore[union-attr]
            if len(shapes) == 1 and None not in parts
            else None
        )
        check(f"{' + '.join(terms)} == embed_ln.hook_in", terms, total, get("embed_ln.hook_in"))
    if has("embed_ln.hook_out") and n:
        check(
            "embed_ln.hook_out == blocks.0.hook_in",
            ("embed_ln.hook_out",),
            get("embed_ln.hook_out"),
            get("blocks.0.hook_in"),
        )
    for i in range(n - 1):
        a, b = f"blocks.{i}.hook_out", f"blocks.{i + 1}.hook_in"
        check(f"{a} == {b}", (a, b), get(a), get(b))
    # A masked LM's head transform reads the last block; its norm is the final one.
    last_reader = "mlm_head.hook_in" if info.head_transform else "ln_final.hook_in"
    if n and has(last_reader):
        a = f"blocks.{n - 1}.hook_out"
        check(f"{a} == {last_reader}", (a, last_reader), get(a), get(last_reader))
    for i in range(n):
        try:
            checks.extend(
                _block_checks(
                    i, cache, info, rtol, W_O, b_O, attn_softcap, score_bias, attention_sinks
                )
            )
        except (RuntimeError, ValueError, IndexError) as exc:
            # Shapes the structure does not predict (per-layer head sizes): nothing inside
            # this block is vouched for.
            inside = tuple(n for n in cache if n.startswith(f"blocks.{i}.") and n.count(".") > 2)
            checks.append(
                CertificationCheck(
                    f"blocks.{i}: its sublayer equations",
                    inside,
                    False,
                    math.inf,
                    0.0,
                    f"could not be evaluated: {type(exc).__name__}: {exc}",
                )
            )
    for prefix in ("ln_final", "embed_ln"):
        checks.extend(_norm_checks(prefix, cache, info, rtol))
    return checks


def _block_checks(
    i: int,
    cache: Mapping[str, torch.Tensor],
    info: ModelInfo,
    rtol: float,
    W_O: torch.Tensor | None,
    b_O: torch.Tensor | None,
    attn_softcap: float | None,
    score_bias: bool,
    attention_sinks: bool = False,
) -> list[CertificationCheck]:

    b = f"blocks.{i}."
    out: list[CertificationCheck] = []

    def get(name: str) -> torch.Tensor | None:
        return cache.get(b + name)

    def add(*parts: str) -> torch.Tensor | None:
        values = [get(p) for p in parts]
        if any(v is None for v in values):
            return None
        return sum((v.double() for v in values[1:]), values[0].double())  # type: ignore[union-attr]

    def check(
        equation: str, hooks: Iterable[str], got: torch.Tensor | None, want: torch.Tensor | None
    ) -> None:
        hooks = tuple(hooks)
        if not any(b + h in cache for h in hooks):
            return  # none of its sites is served (an opaque block): nothing to vouch for
        text = equation.replace("@", b)
        out.append(compare(text, (b + h for h in hooks), got, want, rtol=rtol))

    if info.mixer:
        check(
            "@hook_out == @hook_in + @mixer.hook_out",
            ("mixer.hook_out",),
            add("hook_in", "mixer.hook_out"),
            get("hook_out"),
        )
        if b + "ln1.hook_out" in cache:
            check(
                "@mixer.hook_in == @ln1.hook_out",
                ("mixer.hook_in", "ln1.hook_out"),
                get("mixer.hook_in"),
                get("ln1.hook_out"),
            )
        if b + "ln1.hook_in" in cache:
            check("@ln1.hook_in == @hook_in", ("ln1.hook_in",), get("ln1.hook_in"), get("hook_in"))
        out.extend(_norm_checks(b + "ln1", cache, info, rtol))
        return out
    if info.post_residual_norm:
        _post_residual_norm_checks(check, get, add, info.cross_attention)
    else:
        _residual_checks(check, get, add, info, cache, b)
    for qk in ("q", "k"):
        if b + f"attn.{qk}_norm.hook_in" in cache:
            # The QK-norm reads the projection (hook_q/hook_k are taken before it).
            check(
                f"@attn.{qk}_norm.hook_in == @attn.hook_{qk}",
                (f"attn.{qk}_norm.hook_in",),
                get(f"attn.{qk}_norm.hook_in"),
                get(f"attn.hook_{qk}"),
            )
    for norm in ("ln1", "ln2", "ln3", "ln1_post", "ln2_post", "attn.q_norm", "attn.k_norm"):
        out.extend(_norm_checks(b + norm, cache, info, rtol))
    out.extend(
        attention_checks(
            b, cache, info, rtol, W_O, b_O, attn_softcap, i, score_bias, attention_sinks
        )
    )
    if info.cross_attention:
        # Cross-attention's own equations (z from pattern and values; its keys and values
        # come from the encoder, its projection is the driver's to check).
        out.extend(attention_checks(b + "cross_", cache, info, rtol, None, None, None, i, True))
    out.extend(_mlp_checks(b, cache, info, rtol))
    out.extend(_router_checks(b, cache, info))
    if info.d_shared_expert is not None:
        out.extend(_shared_expert_checks(b, cache, info, rtol))
    return out


_Check = Callable[[str, Iterable[str], "torch.Tensor | None", "torch.Tensor | None"], None]
_Get = Callable[[str], "torch.Tensor | None"]
_Add = Callable[..., "torch.Tensor | None"]


def _post_residual_norm_checks(check: _Check, get: _Get, add: _Add, cross: bool) -> None:
    """Where a post-LN block (BERT) joins its sublayers: ``h = ln1(x + attn(x))``, ``out =
    ln2(h + mlp(h))``; with cross-attention (BART's decoder) ``h2 = ln2(h + cross(h))``
    comes between and ``ln3`` is the last norm (``check`` records each equation)."""
    check("@attn.hook_in == @hook_in", ("attn.hook_in",), get("attn.hook_in"), get("hook_in"))
    check(
        "@ln1.hook_in == @hook_in + @attn.hook_out",
        ("ln1.hook_in", "attn.hook_out"),
        add("hook_in", "attn.hook_out"),
        get("ln1.hook_in"),
    )
    before_mlp, last = "ln1", "ln2"
    if cross:
        check(
            "@cross_attn.hook_in == @ln1.hook_out",
            ("cross_attn.hook_in", "ln1.hook_out"),
            get("cross_attn.hook_in"),
            get("ln1.hook_out"),
        )
        check(
            "@ln2.hook_in == @ln1.hook_out + @cross_attn.hook_out",
            ("ln2.hook_in", "cross_attn.hook_out"),
            add("ln1.hook_out", "cross_attn.hook_out"),
            get("ln2.hook_in"),
        )
        before_mlp, last = "ln2", "ln3"
    check(
        f"@mlp.hook_in == @{before_mlp}.hook_out",
        ("mlp.hook_in", f"{before_mlp}.hook_out"),
        get("mlp.hook_in"),
        get(f"{before_mlp}.hook_out"),
    )
    check(
        f"@{last}.hook_in == @{before_mlp}.hook_out + @mlp.hook_out",
        (f"{last}.hook_in", "mlp.hook_out"),
        add(f"{before_mlp}.hook_out", "mlp.hook_out"),
        get(f"{last}.hook_in"),
    )
    check(
        f"@hook_out == @{last}.hook_out",
        (f"{last}.hook_out",),
        get(f"{last}.hook_out"),
        get("hook_out"),
    )


def _residual_checks(
    check: _Check,
    get: _Get,
    add: _Add,
    info: ModelInfo,
    cache: Mapping[str, torch.Tensor],
    b: str,
) -> None:
    """Where a pre-norm, sandwich or parallel block adds its sublayers to the residual
    stream (``check`` records each equation)."""
    attn_out = "ln1_post.hook_out" if info.sandwich_norm else "attn.hook_out"
    mlp_out = "ln2_post.hook_out" if info.sandwich_norm else "mlp.hook_out"
    if info.sandwich_norm:
        check(
            "@attn.hook_out == @ln1_post.hook_in",
            ("attn.hook_out", "ln1_post.hook_in"),
            get("attn.hook_out"),
            get("ln1_post.hook_in"),
        )
        check(
            "@mlp.hook_out == @ln2_post.hook_in",
            ("mlp.hook_out", "ln2_post.hook_in"),
            get("mlp.hook_out"),
            get("ln2_post.hook_in"),
        )
    if info.parallel_attn_mlp:
        check(
            f"@hook_out == @hook_in + @{attn_out} + @{mlp_out}",
            (attn_out, mlp_out),
            add("hook_in", attn_out, mlp_out),
            get("hook_out"),
        )
    else:
        check(
            f"@ln2.hook_in == @hook_in + @{attn_out}",
            ("ln2.hook_in", attn_out),
            add("hook_in", attn_out),
            get("ln2.hook_in"),
        )
        if info.cross_attention:
            # A decoder block of an encoder-decoder (T5): cross-attention between the two.
            check(
                "@ln3.hook_in == @ln2.hook_in + @cross_attn.hook_out",
                ("ln3.hook_in", "cross_attn.hook_out"),
                add("ln2.hook_in", "cross_attn.hook_out"),
                get("ln3.hook_in"),
            )
        before_mlp = "ln3" if info.cross_attention else "ln2"
        check(
            f"@hook_out == @{before_mlp}.hook_in + @{mlp_out}",
            (f"{before_mlp}.hook_in", mlp_out),
            add(f"{before_mlp}.hook_in", mlp_out),
            get("hook_out"),
        )
    if b + "ln1.hook_in" in cache:
        check("@ln1.hook_in == @hook_in", ("ln1.hook_in",), get("ln1.hook_in"), get("hook_in"))
    if b + "ln1.hook_out" in cache and b + "attn.hook_in" in cache:
        check(
            "@attn.hook_in == @ln1.hook_out",
            ("attn.hook_in", "ln1.hook_out"),
            get("attn.hook_in"),
            get("ln1.hook_out"),
        )
    elif b + "ln1.hook_in" not in cache and b + "attn.hook_in" in cache:
        # No norm before attention (OLMo 2 and 3, EXAONE 4): it reads the block input.
        check("@attn.hook_in == @hook_in", ("attn.hook_in",), get("attn.hook_in"), get("hook_in"))
    if info.cross_attention:
        for reader, norm in (("cross_attn", "ln2"), ("mlp", "ln3")):
            check(
                f"@{reader}.hook_in == @{norm}.hook_out",
                (f"{reader}.hook_in", f"{norm}.hook_out"),
                get(f"{reader}.hook_in"),
                get(f"{norm}.hook_out"),
            )
    elif b + "ln2.hook_out" in cache and b + "mlp.hook_in" in cache:
        check(
            "@mlp.hook_in == @ln2.hook_out",
            ("mlp.hook_in", "ln2.hook_out"),
            get("mlp.hook_in"),
            get("ln2.hook_out"),
        )
    elif info.parallel_attn_mlp and b + "ln1.hook_out" in cache and b + "mlp.hook_in" in cache:
        # One norm feeds both sublayers of a parallel block (GPT-J, Phi, Cohere).
        check(
            "@mlp.hook_in == @ln1.hook_out",
            ("mlp.hook_in",),
            get("mlp.hook_in"),
            get("ln1.hook_out"),
        )
    elif not info.parallel_attn_mlp and b + "ln2.hook_in" in cache and b + "mlp.hook_in" in cache:
        # No norm before the MLP: it reads the residual between the sublayers.
        check(
            "@mlp.hook_in == @ln2.hook_in", ("mlp.hook_in",), get("mlp.hook_in"), get("ln2.hook_in")
        )


def _shared_expert_checks(
    b: str, cache: Mapping[str, torch.Tensor], info: ModelInfo, rtol: float
) -> list[CertificationCheck]:
    """The shared expert is a gated MLP, and the block's MLP output is the routed experts'
    output plus the shared expert's, scaled by the sigmoid of its gate where it has one."""
    import torch

    m, s = b + "mlp.", b + "mlp.shared_expert."
    out: list[CertificationCheck] = []
    pre, lin, post = (cache.get(s + n) for n in ("hook_pre", "hook_pre_linear", "hook_post"))
    act = _activation(info.act_fn)
    if act is not None and (pre is not None or post is not None):
        rebuilt = act(pre.double()) * lin.double() if pre is not None and lin is not None else None
        hooks = (s + "hook_pre", s + "hook_pre_linear", s + "hook_post")
        out.append(
            compare(
                f"{s}hook_post == act({s}hook_pre) * {s}hook_pre_linear",
                hooks,
                rebuilt,
                post,
                rtol=rtol,
            )
        )
    routed, shared, gate = (
        cache.get(m + "experts.hook_out"),
        cache.get(s + "hook_out"),
        cache.get(s + "hook_gate"),
    )
    if routed is None and shared is None:
        return out
    gated = gate is not None
    total = None
    if routed is not None and shared is not None:
        scale = torch.sigmoid(gate.double()) if gate is not None else 1.0
        total = routed.double() + scale * shared.double()
    what = f"sigmoid({s}hook_gate) * {s}hook_out" if gated else f"{s}hook_out"
    hooks = (m + "experts.hook_out", s + "hook_out", *((s + "hook_gate",) if gated else ()))
    out.append(
        compare(
            f"{m}hook_out == {m}experts.hook_out + {what}",
            hooks,
            total,
            cache.get(m + "hook_out"),
            rtol=rtol,
        )
    )
    return out


def _router_checks(
    b: str, cache: Mapping[str, torch.Tensor], info: ModelInfo
) -> list[CertificationCheck]:
    """The chosen experts are the top-k of the router logits, and only they carry weight."""
    import torch

    m = b + "mlp."
    logits, weights, indices = (
        cache.get(m + s)
        for s in ("hook_router_logits", "hook_expert_weights", "hook_expert_indices")
    )
    if logits is None and weights is None and indices is None:
        return []
    names = (m + "hook_router_logits", m + "hook_expert_indices")
    if logits is None or indices is None:
        return [
            compare(
                f"{m}hook_expert_indices == top-k({m}hook_router_logits)",
                names,
                None,
                None,
                rtol=0.0,
            )
        ]
    k = indices.shape[-1]
    top = torch.topk(logits.double(), k, dim=-1).indices.sort(dim=-1).values
    chosen = indices.long().sort(dim=-1).values
    check = compare(
        f"{m}hook_expert_indices == top-k({m}hook_router_logits)",
        names,
        top.double(),
        chosen.double(),
        rtol=0.0,
    )
    out = [check]
    if weights is not None:
        picked = torch.zeros_like(weights, dtype=torch.bool).scatter(-1, indices.long(), True)
        stray = weights.double().masked_fill(picked, 0.0)
        out.append(
            compare(
                f"{m}hook_expert_weights is zero off {m}hook_expert_indices",
                (m + "hook_expert_weights",),
                stray,
                torch.zeros_like(stray),
                rtol=0.0,
            )
        )
    del info
    return out


def _norm_checks(
    prefix: str, cache: Mapping[str, torch.Tensor], info: ModelInfo, rtol: float
) -> list[CertificationCheck]:
    """``hook_normalized * hook_scale`` gives back the (centred, for LayerNorm) input."""
    x, scale, normed = (
        cache.get(f"{prefix}.{s}") for s in ("hook_in", "hook_scale", "hook_normalized")
    )
    if normed is None and scale is None:
        return []
    if x is None or scale is None or normed is None:
        hooks = [f"{prefix}.hook_scale", f"{prefix}.hook_normalized"]
        return [
            compare(
                f"{prefix}.hook_normalized * {prefix}.hook_scale == {prefix}.hook_in",
                hooks,
                None,
                None,
                rtol=rtol,
            )
        ]
    centred = x.double()
    if info.normalization_type == "LN":
        centred = centred - centred.mean(dim=-1, keepdim=True)
    rebuilt = normed.double() * scale.double()
    what = "hook_in - mean" if info.normalization_type == "LN" else "hook_in"
    return [
        compare(
            f"{prefix}.hook_normalized * {prefix}.hook_scale == {prefix}.{what}",
            # The input too: a norm's input no other equation reaches (BERT's embedding
            # norm, which sums word, position and token-type rows) is vouched for here.
            (f"{prefix}.hook_scale", f"{prefix}.hook_normalized", f"{prefix}.hook_in"),
            rebuilt,
            centred,
            rtol=rtol,
        )
    ]


def _mlp_checks(
    b: str, cache: Mapping[str, torch.Tensor], info: ModelInfo, rtol: float
) -> list[CertificationCheck]:
    m = b + "mlp."
    pre, lin, post = (cache.get(m + s) for s in ("hook_pre", "hook_pre_linear", "hook_post"))
    if pre is None or post is None:
        return []
    act = _activation(info.act_fn)
    hooks = [m + "hook_pre", m + "hook_post"] + ([m + "hook_pre_linear"] if info.gated_mlp else [])
    if act is None:
        return []  # an activation tl cannot evaluate: other checks (an edit at hook_post) decide
    rebuilt = act(pre.double())
    if info.gated_mlp:
        if lin is None:
            return [
                compare(
                    f"{m}hook_post == act({m}hook_pre) * {m}hook_pre_linear",
                    hooks,
                    None,
                    None,
                    rtol=rtol,
                )
            ]
        rebuilt = rebuilt * lin.double()
        return [
            compare(
                f"{m}hook_post == act({m}hook_pre) * {m}hook_pre_linear",
                hooks,
                rebuilt,
                post,
                rtol=rtol,
            )
        ]
    return [compare(f"{m}hook_post == act({m}hook_pre)", hooks, rebuilt, post, rtol=rtol)]


_BARE_BLOCKS = re.compile(r"(?<![A-Za-z0-9_])blocks\.")


def stacked_equation_checks(
    cache: Mapping[str, torch.Tensor],
    info: ModelInfo,
    *,
    rtol: float = 1e-4,
    hidden_states: Mapping[str, Iterable[torch.Tensor]] | None = None,
    logits: torch.Tensor | None = None,
    reference_logits: torch.Tensor | None = None,
    W_O: Mapping[str, torch.Tensor] | None = None,
    b_O: Mapping[str, torch.Tensor | None] | None = None,
    score_bias: bool = False,
) -> list[CertificationCheck]:
    """``equation_checks`` on each stack of a model (``ModelInfo.stacks``), in its names.

    Each stack is checked as a one-stack model with its own view of the facts (a decoder
    block's cross-attention and third norm included); the last stack (an encoder-decoder's
    decoder) also takes the model-level sites (``ln_final.*``, ``unembed.*``) and the
    logits.

    Args:
        cache: Canonical name -> captured tensor (one forward).
        info: The model's structure.
        rtol: As ``equation_checks``.
        hidden_states: Stack prefix -> the engine's own input of each of its blocks.
        logits: The driver's logits.
        reference_logits: The engine's own logits without tl.
        W_O: Stack prefix -> its blocks' output projections (``[n_layers, n_heads, d_head,
            d_model]``).
        b_O: Stack prefix -> their biases, or ``None``.
        score_bias: Whether attention scores hold an additive position bias (T5's relative
            bias): then they are not checked against ``q . k``.

    Returns:
        The checks, stack by stack, with the stacks' names in equations and hooks.
    """
    checks: list[CertificationCheck] = []
    last = info.stacks[-1][0]
    for prefix, stack in info.stacks:
        inner: dict[str, torch.Tensor] = {}
        for name, value in cache.items():
            head = name.split(".", 1)[0]
            if head == prefix:
                inner["blocks" + name[len(prefix) :]] = value
            elif prefix == last and head not in STACK_PREFIXES:
                inner[name] = value
        found = equation_checks(
            inner,
            stack,
            rtol=rtol,
            hidden_states=(hidden_states or {}).get(prefix),
            logits=logits if prefix == last else None,
            reference_logits=reference_logits if prefix == last else None,
            W_O=(W_O or {}).get(prefix),
            b_O=(b_O or {}).get(prefix),
            score_bias=score_bias,
        )
        checks += [
            dataclasses.replace(
                c,
                equation=_BARE_BLOCKS.sub(f"{prefix}.", c.equation),
                hooks=tuple(_BARE_BLOCKS.sub(f"{prefix}.", h) for h in c.hooks),
            )
            for c in found
        ]
    return checks
