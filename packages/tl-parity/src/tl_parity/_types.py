"""Values that cross module and process lines: one hook's comparison and the whole report."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["SCHEMA_VERSION", "HookComparison", "ParityReport", "Status"]

#: Bumped whenever a field of the JSON report changes meaning or disappears.
SCHEMA_VERSION = 1

Status = Literal["PASS", "FAIL", "MISSING", "ERROR"]


@dataclass(frozen=True)
class HookComparison:
    """One hook (or the logits) compared between the reference and the candidate.

    Attributes:
        hook: Canonical hook name (``"logits"`` for the logits row).
        shape: Shape of the candidate tensor (of the reference when the candidate is missing).
        dtype: Candidate dtype as a string, e.g. ``"float32"``.
        max_abs: Largest absolute difference over real (non-padding) positions.
        max_rel: Largest ``|cand - ref| / (|ref| + atol)`` over those positions.
        atol: Absolute tolerance of the band used.
        rtol: Relative tolerance of the band used.
        status: ``PASS``/``FAIL``; ``MISSING`` when the candidate did not return the hook;
            ``ERROR`` when the comparison could not be made (shape mismatch, no reference).
        diagnostic: A likely cause for a ``FAIL``/``ERROR`` row, if one was found.
        layer: Block index for ``blocks.{i}.*`` hooks, else ``None``.
        kind: The hook name without the block prefix, e.g. ``"hook_out"``, ``"attn.hook_z"``.
    """

    hook: str
    shape: tuple[int, ...]
    dtype: str
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    status: Status
    diagnostic: str | None = None
    layer: int | None = None
    kind: str = ""

    @property
    def passed(self) -> bool:
        """True for a ``PASS`` row."""
        return self.status == "PASS"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``shape`` as a list; non-finite floats as strings)."""
        d = asdict(self)
        d["shape"] = list(self.shape)
        for key in ("max_abs", "max_rel"):
            d[key] = _float_out(d[key])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HookComparison:
        """Inverse of :meth:`to_dict`."""
        return cls(
            hook=d["hook"],
            shape=tuple(int(x) for x in d["shape"]),
            dtype=d["dtype"],
            max_abs=float(d["max_abs"]),
            max_rel=float(d["max_rel"]),
            atol=float(d["atol"]),
            rtol=float(d["rtol"]),
            status=d["status"],
            diagnostic=d.get("diagnostic"),
            layer=d.get("layer"),
            kind=d.get("kind", ""),
        )


def _float_out(x: float) -> float | str:
    # JSON has no NaN/inf; float("nan") / float("inf") read these strings back.
    return x if x == x and x not in (float("inf"), float("-inf")) else str(x)


@dataclass
class ParityReport:
    """A full parity run: every hook row, the logits row, argmax agreement and metadata.

    Attributes:
        model: The model path or preset that both drivers booted.
        reference: Reference driver name (e.g. ``"hf"``).
        candidate: Candidate driver name (e.g. ``"vllm"``).
        dtype: Compute dtype of the run (``"float32"``, ``"bfloat16"``, ``"float16"``).
        hooks: One row per hook the candidate claims to serve (after the layer filter).
        logits: The logits row, or ``None`` when the candidate gives no sequence logits.
        argmax_agreement: Fraction of real positions whose top token agrees, or ``None``.
        non_fireable: Hooks the candidate declares it cannot serve, with the reason.
        error: Set when a driver crashed or could not boot; the rows may then be empty.
        schema_version: Version of this structure's JSON form.
        extra: Facts about the run outside the comparison (prompt lengths, prompt count, ...).
    """

    model: str
    reference: str
    candidate: str
    dtype: str
    hooks: list[HookComparison]
    logits: HookComparison | None
    argmax_agreement: float | None
    non_fireable: dict[str, str]
    error: str | None = None
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """True when there is no error and every row (hooks and logits) is ``PASS``."""
        if self.error is not None:
            return False
        rows = [*self.hooks, *([self.logits] if self.logits is not None else [])]
        return bool(rows) and all(r.status == "PASS" for r in rows)

    @property
    def failures(self) -> list[HookComparison]:
        """Every row that is not ``PASS`` (hooks first, then the logits)."""
        rows = [*self.hooks, *([self.logits] if self.logits is not None else [])]
        return [r for r in rows if r.status != "PASS"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict carrying ``schema_version``."""
        return {
            "schema_version": self.schema_version,
            "model": self.model,
            "reference": self.reference,
            "candidate": self.candidate,
            "dtype": self.dtype,
            "passed": self.passed,
            "error": self.error,
            "argmax_agreement": self.argmax_agreement,
            "logits": self.logits.to_dict() if self.logits is not None else None,
            "hooks": [h.to_dict() for h in self.hooks],
            "non_fireable": dict(self.non_fireable),
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParityReport:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: When ``d`` was written by a newer schema than this package reads.
        """
        version = int(d.get("schema_version", 1))
        if version > SCHEMA_VERSION:
            raise ValueError(
                f"parity report has schema_version {version}, this tl-parity reads up to "
                f"{SCHEMA_VERSION}; upgrade tl-parity"
            )
        return cls(
            model=d["model"],
            reference=d["reference"],
            candidate=d["candidate"],
            dtype=d["dtype"],
            hooks=[HookComparison.from_dict(h) for h in d.get("hooks", [])],
            logits=HookComparison.from_dict(d["logits"]) if d.get("logits") else None,
            argmax_agreement=d.get("argmax_agreement"),
            non_fireable=dict(d.get("non_fireable", {})),
            error=d.get("error"),
            schema_version=version,
            extra=dict(d.get("extra", {})),
        )

    def to_json(self, path: str | Path | None = None) -> str:
        """The report as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text
