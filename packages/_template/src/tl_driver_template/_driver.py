"""``TemplateDriver``: the Driver contract over the stand-in engine, step by step.

The four things every driver does: (1) at boot, describe the model's hook names in a
``HookNamespace`` (what it serves, what specs may edit, why the rest cannot fire);
(2) take one ``ForwardRequest`` in ``run``: the bridge (or ``RequestForward.forward``, the
keyword form) already resolved its names through that namespace and planned its specs, so
the driver trusts it; (3) during the run, at each site, apply the prompt's compiled edits
and then capture; (4) return right-padded tensors with each prompt's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tl_core import ModelInfo, UserError
from tl_core.driver_api import (
    AffineEdit,
    ForwardRequest,
    ForwardResult,
    HookNamespace,
    InterventionPlan,
    NamespaceFacts,
    RequestForward,
    SamplingOptions,
    Tokenizer,
    canonical_hook_names,
    compile_specs,
    next_tokens,
)
from tl_driver_template._engine import ToyEngine

__all__ = ["TemplateDriver"]

_FEATURES = frozenset({"generation", "batching", "position_interventions"})
_NOT_EXPOSED = (
    "the template's engine exposes residual-stream sites only; serve more by hooking more "
    "of your engine's modules"
)


def _sites(info: ModelInfo) -> dict[str, Any]:
    """Canonical name -> the engine site that holds it."""
    sites: dict[str, Any] = {"embed.hook_out": "embed", "unembed.hook_out": "logits"}
    sites.update({f"blocks.{i}.hook_out": ("block", i) for i in range(info.n_layers)})
    return sites


class TemplateDriver(RequestForward, NamespaceFacts):
    """A remote-kind driver: the engine runs the model, the driver reads and edits sites.

    Attributes:
        name: The entry-point name users type (``"template"``; a copy picks its own).
        provides_sequence_logits: True: the engine returns logits at every position.
        tokenizer: The engine's tokenizer (anything with the ``Tokenizer`` protocol).
    """

    name = "template"
    provides_sequence_logits = True

    def __init__(self, engine: ToyEngine) -> None:
        self._engine: ToyEngine | None = engine
        self.tokenizer: Tokenizer = engine.tokenizer
        self._sites = _sites(engine.info)
        served = {*self._sites, "embed.hook_in"}  # token ids come from the request itself
        reasons = {"unembed.hook_out": "the logits are read after the engine sampled"}
        reasons.update({n: _NOT_EXPOSED for n in _every_name(engine.info) if n not in served})
        self._namespace = HookNamespace.build(
            engine.info,
            served,
            read_only={"unembed.hook_out": reasons.pop("unembed.hook_out")},
            reasons=reasons,
            driver=self.name,
        )

    @classmethod
    def boot(cls, model: Any = None, **options: Any) -> TemplateDriver:
        """Start the engine; check every option before that, naming the bad one."""
        return cls(ToyEngine(model, **options))

    @property
    def info(self) -> ModelInfo:
        """The model's sizes and structure."""
        return self.namespace.info

    def supports(self, feature: str) -> bool:
        """Whether the driver has ``feature``."""
        return feature in _FEATURES

    def run(self, request: ForwardRequest) -> ForwardResult:
        """Run one validated request (see ``tl_core.driver_api.ForwardRequest``).

        The bridge built the request: names are canonical, specs planned, ids in range.
        ``forward``, the keyword form, comes from ``RequestForward``.
        """
        engine = self._running()
        rows = request.batch.rows()
        lengths = request.lengths
        names = list(request.capture)
        per_prompt = [
            self._run_one(engine, row, b, names, request.plan) for b, row in enumerate(rows)
        ]
        captured = {n: _pad([p[0][n] for p in per_prompt], lengths) for n in names}
        logits = None
        if request.logits == "all":
            logits = _pad([p[1] for p in per_prompt], lengths)
        elif request.logits == "last":
            logits = torch.stack([p[1][-1:] for p in per_prompt])
        new = None
        if request.max_new_tokens >= 1:
            new = self._generate(
                engine,
                rows,
                request.plan,
                request.max_new_tokens,
                request.sampling,
                request.stop_at_eos,
            )
        return ForwardResult(logits, captured, new, None, lengths)

    def _run_one(
        self, engine: ToyEngine, row: list[int], b: int, names: list[str], plan: InterventionPlan
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        store: dict[str, torch.Tensor] = {"embed.hook_in": torch.tensor(row)}
        specs = plan.per_prompt[b]
        by_site = {site: name for name, site in self._sites.items()}

        def visit(site: Any, x: torch.Tensor) -> torch.Tensor:
            name = by_site[site]
            if specs.get(name):
                # Specs compile to x * scale + bias, which a compiled engine can run too.
                edit: AffineEdit = compile_specs(
                    specs[name],
                    feature_shape=(x.shape[-1],),
                    seq_len=x.shape[1],
                    dtype=x.dtype,
                    device=x.device,
                )
                x = edit.apply(x)
            if name in names:
                store[name] = x[0].clone()  # engines reuse buffers: keep a copy
            return x

        logits = engine.run(row, visit)
        return store, logits

    def _generate(
        self,
        engine: ToyEngine,
        rows: list[list[int]],
        plan: InterventionPlan,
        n: int,
        sampling: SamplingOptions,
        stop_at_eos: bool,
    ) -> torch.Tensor:
        """Greedy or sampled tokens, the prompt's specs active at every step."""
        eos = self.tokenizer.eos_token_id if stop_at_eos else None
        out = []
        for b, row in enumerate(rows):
            tokens = list(row)
            for _ in range(n):
                _, logits = self._run_one(engine, tokens, b, [], plan)
                token = int(next_tokens(logits[-1:], sampling)[0])
                tokens.append(token)
                if token == eos:
                    break
            new = tokens[len(row) :]
            out.append(new + [eos if eos is not None else 0] * (n - len(new)))
        return torch.tensor(out, dtype=torch.long)

    def _running(self) -> ToyEngine:
        if self._engine is None:
            raise UserError("this template driver is closed; boot a new one")
        return self._engine

    def close(self) -> None:
        """Release the engine; safe to call twice."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()


def _every_name(info: ModelInfo) -> list[str]:
    return canonical_hook_names(info, include_attn_result=True)


def _pad(rows: list[torch.Tensor], lengths: Sequence[int]) -> torch.Tensor:
    width = max(lengths)
    out = rows[0].new_zeros((len(rows), width, *rows[0].shape[1:]))
    for b, row in enumerate(rows):
        out[b, : row.shape[0]] = row
    return out
