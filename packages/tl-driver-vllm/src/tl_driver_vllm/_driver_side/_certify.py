"""Certification on the booted vLLM engine: tl-core's equations over one capture.

A layout read from the hf driver's description (``_derive``) is a claim about where vLLM's
Transformers backend keeps each site; one forward of a few token ids, capturing every
served hook, checks it with the same engine-independent equations the hf driver uses
(residual chain, block equation, norms, attention, MLP). A hook whose equation fails is
withheld with the equation as its reason; a failing residual stream refuses the boot.
"""

from __future__ import annotations

from typing import Any

import torch

from tl_core import ConfigError
from tl_core.architecture import uses_alibi
from tl_core.certification import (
    Certification,
    CertificationCheck,
    certified_level,
    equation_checks,
    silent_hook_checks,
    statuses_from_checks,
)
from tl_core.driver_api import canonical_hook_names

__all__ = ["ANCHOR_LOGPROBS", "PROBE_LENGTH", "certify_engine", "refusal"]

#: vLLM's own log-probabilities of this many top tokens anchor tl's readout (vLLM's default
#: ``max_logprobs``).
ANCHOR_LOGPROBS = 20

#: Token ids in the certification forward: enough positions for the attention equations.
PROBE_LENGTH = 8

#: Relative tolerance of every equation, by the engine's dtype: a sum or product vLLM
#: computes rounds once in that precision.
_RTOL = {torch.float64: 1e-6, torch.float32: 1e-4}
_RTOL_HALF = 3e-2


def _probe_ids(vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(min(4, vocab - 1), vocab, (1, PROBE_LENGTH), generator=generator)


def certify_engine(
    driver: Any, config: Any, *, model: str, description: dict[str, str], derived: bool
) -> Certification:
    """Check every served hook of a booted vLLM driver with tl-core's equations.

    Args:
        driver: The ``VLLMDriver``.
        config: The checkpoint's ``transformers`` config.
        model: What was booted (for the report).
        description: Facts about the layout (shown in the report).
        derived: Whether the layout was read from the hf driver's description. A hook no
            equation covers is ``real`` either way: a row's parity test vouches for it, and
            a derived layout serves only what the hf driver certified (``_derive``).

    Returns:
        The report; ``statuses`` say which hooks hold.
    """
    info = driver.info
    ids = _probe_ids(info.d_vocab)
    names = sorted(driver.supported_hook_points)
    # The driver's own forward: a hook that never fired is missing from it, not an error.
    # One greedy token: vLLM picks it from logits it computes itself, the run's anchor.
    result = driver.forward(ids.tolist(), capture=names, max_new_tokens=1, stop_at_eos=False)
    logits = result.logits
    captured = dict(result.captured)
    dtype = next(iter(captured.values())).dtype if captured else torch.float32
    rtol = _RTOL.get(dtype, _RTOL_HALF)
    softcap = getattr(config, "attn_logit_softcapping", None)
    checks = equation_checks(
        captured, info, rtol=rtol, logits=logits,
        attn_softcap=float(softcap) if softcap else None,
        score_bias=uses_alibi(config),
        attention_sinks=driver._family.sinks,
    )  # fmt: skip
    anchor = _engine_logprobs(result.raw_output)
    if logits is not None and anchor is not None:
        checks.append(_logprob_check(logits[0, -1].float(), *anchor, rtol))
    elif logits is not None and result.new_tokens is not None:
        checks.append(_greedy_check(logits[0, -1].float(), int(result.new_tokens[0, 0]), rtol))
    checks += silent_hook_checks(names, captured)
    namespace = driver.namespace
    statuses = statuses_from_checks(
        canonical_hook_names(info, include_attn_result=True, include_split_qkv_input=True),
        checks,
        described=True,
        strict=True,
        absent=namespace.non_fireable_reasons,
        read_only={
            n: namespace.reasons.get(n, "served for capture only") for n in namespace.read_only
        },
    )
    return Certification(
        model=model,
        driver="vllm",
        family=description.get("family", info.architecture),
        inferred=derived,
        level=certified_level(statuses, info.n_layers),
        description=description,
        checks=tuple(checks),
        statuses=statuses,
        architecture=driver.architecture,
    )


def _engine_logprobs(outputs: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(token ids, log-probabilities)`` vLLM reported for its first sampled position of
    the first prompt, or ``None`` when it reported none."""
    try:
        step = outputs[0].outputs[0].logprobs[0]
    except (AttributeError, IndexError, TypeError):
        return None
    if not step:
        return None
    ids = torch.tensor([int(t) for t in step])
    values = torch.tensor([float(v.logprob) for v in step.values()], dtype=torch.float64)
    return ids, values


def _logprob_check(
    last: torch.Tensor, ids: torch.Tensor, theirs: torch.Tensor, rtol: float
) -> CertificationCheck:
    """vLLM's own log-probabilities of its top tokens at the last position equal the
    log-softmax of the logits tl rebuilds there from the final norm and unembedding, so the
    readout tl serves is the engine's (a wrong final norm, unembedding, scale or soft-cap
    moves them)."""
    ours = torch.log_softmax(last.double(), dim=-1)[ids]
    error = float((ours - theirs).abs().max())
    allowed = rtol * (1.0 + float(theirs.abs().max()))
    return CertificationCheck(
        f"logits: log_softmax(tl's logits) == the engine's own log-probabilities of its top {len(ids)} tokens "
        "at the last position",
        ("ln_final.hook_out", "unembed.hook_out"),
        error <= allowed,
        error,
        allowed,
    )


def _greedy_check(last: torch.Tensor, token: int, rtol: float) -> CertificationCheck:
    """The engine's own greedy token is the top of the logits tl rebuilds from the final
    norm (within rounding of the top), so the final norm and unembedding tl read are the
    engine's."""
    top = float(last.max())
    gap = top - float(last[token])
    allowed = rtol * (abs(top) + 1.0)
    return CertificationCheck(
        "logits: the engine's own greedy token at the last position is the top of tl's logits",
        ("ln_final.hook_out", "unembed.hook_out"),
        gap <= allowed,
        gap,
        allowed,
        ""
        if gap <= allowed
        else f"the engine chose {token}; tl's logits prefer {int(last.argmax())}",
    )


def refusal(cert: Certification, architecture: str) -> ConfigError | None:
    """Why a boot is refused after certification: the residual stream or logits fail."""
    if cert.residual_holds:
        return None
    first = next(c for c in cert.failed)
    return ConfigError(
        f"the vllm driver cannot serve {architecture!r}: where it placed tl's sites on vLLM's "
        f"model fails certification ({first.line()}); use the hf driver for it and report it."
    )
