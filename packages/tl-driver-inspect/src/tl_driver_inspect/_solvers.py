"""The solvers: ``intervene`` (steer this sample) and ``capture_activations`` (generate,
then save this sample's activations).

Design: ``intervene`` only sets up the sample (its specs apply to every later generation
of that sample, by ``generate()`` or ``capture_activations``); ``capture_activations`` is
a generation solver, used in place of ``generate()``: it generates, then runs one forward
over prompt plus generated tokens with the same specs and captures there. Both check what
they can when built (names against the vocabulary, spec schemas, the output folder) and
the rest against the model at each sample, before any generation.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from inspect_ai.model import get_model
from inspect_ai.solver import Generate, Solver, TaskState, solver

from tl_core import UserError, canonical_name
from tl_driver_inspect._context import sample_scope
from tl_driver_inspect._specs import absolute_specs, check_hooks, check_specs, normalise_specs

__all__ = ["capture_activations", "intervene"]

_PROVIDERS = "'tl_bridge/<model>' or 'tl_bridge_vllm/<model>' (also 'tl_hf/', 'tl_vllm/')"


def _tl_api(what: str) -> Any:
    """The provider of the model under evaluation, which must be one of this package's."""
    from tl_driver_inspect._provider import TLProvider

    model = get_model()
    if not isinstance(model.api, TLProvider):
        provider = str(model).split("/", 1)[0]
        if provider in ("tl_bridge", "tl_bridge_vllm"):
            other = type(model.api).__module__.split(".")[0]
            raise UserError(
                f"{what}: inspect resolved the provider name {provider!r} to {other!r}'s "
                f"provider ({type(model.api).__name__}), not tl-driver-inspect's: both "
                "packages register that name (transformer-lens 4.3 does). Use the "
                "unambiguous names 'tl_hf/<model>' or 'tl_vllm/<model>', or uninstall the other "
                "package from this environment"
            )
        raise UserError(
            f"{what} needs a tl model provider, but the model under evaluation is "
            f"{str(model)!r}; run the eval with --model {_PROVIDERS} (tl-driver-inspect)"
        )
    return model.api


@solver
def intervene(specs: dict[str, Any]) -> Solver:
    """Apply tl intervention specs to this sample's later generations.

    ``solver=[intervene({"blocks.1.hook_out": {"op": "add", "value": 2.0}}), generate()]``
    is a steering eval. Several ``intervene`` solvers compose in order.

    Args:
        specs: Hook name (aliases allowed) -> one spec or a list of specs, in tl's spec
            language (``{"op": "scale", "factor": 0.5, "pos": -1}``, ...).

    Raises:
        SpecError, HookNameError: When built, for malformed specs or unknown names; at the
            first sample, for hooks the model lacks or cannot edit, or wrong widths.
        UserError: At the first sample, when the model is not a tl provider.
    """
    normalised = normalise_specs(specs)

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        api = _tl_api("intervene")
        check_specs(normalised, api.namespace)
        scope = sample_scope(state)
        for hook, items in normalised.items():
            scope.specs.setdefault(hook, []).extend(items)
        return state

    return solve


@solver
def capture_activations(
    hooks: str | Sequence[str],
    output_dir: str | os.PathLike[str] = "tl_activations",
    reduce: str | Callable[..., Any] | None = None,
    positions: str | Sequence[int] | None = None,
    store_key: str = "tl_activations",
) -> Solver:
    """Generate (in place of ``generate()``), then save the sample's activations.

    For each sample and epoch: the completion is generated with the sample's specs, then one
    forward over prompt plus generated tokens (same specs) captures ``hooks``, and
    ``<output_dir>/<sample_id>_epoch<k>.safetensors`` gets one tensor per canonical hook
    name (batch dimension dropped) plus ``tokens`` (the ids). The file is written
    atomically. The sample store gets, under ``store_key``: ``path``, ``n_tokens``,
    ``n_prompt_tokens``, ``hooks``, per-hook ``shapes`` and ``norms``, and ``values`` when
    ``reduce`` leaves at most 64 numbers. With tool calls, the last generation is captured.

    Args:
        hooks: Hook names (aliases allowed; resolved per model).
        output_dir: Folder for the files (created; must be writable).
        reduce: ``None`` (keep every position), ``"mean"``, ``"last"``, or a callable
            ``tensor[pos, ...] -> tensor``.
        positions: ``None`` (all), ``"prompt"``, ``"generated"``, or indices (negative from
            the end of prompt plus completion). Attention patterns select query positions.
        store_key: Key of the summary in the sample store.

    Raises:
        HookNameError, UserError: When built, for unknown names (with suggestions), bad
            options or an unwritable folder; at each sample before generation, for a
            non-tl model, hooks the model cannot serve, or bad specs. A response served by
            inspect's cache (which skips the provider) is an error, never a missing file.
    """
    from tl_driver_inspect._store import check_output_dir

    names = [hooks] if isinstance(hooks, str) else list(hooks)
    if not names:
        raise UserError("capture_activations: hooks is empty; name at least one hook")
    for name in names:
        canonical_name(name)
    if not (reduce is None or reduce in ("mean", "last") or callable(reduce)):
        raise UserError(
            f"capture_activations: reduce must be None, 'mean', 'last' or a callable, got {reduce!r}"
        )
    if not (
        positions is None
        or positions in ("prompt", "generated")
        or (not isinstance(positions, str) and all(isinstance(p, int) for p in positions))
    ):
        raise UserError(
            f"capture_activations: positions must be None, 'prompt', 'generated' or a list of "
            f"ints, got {positions!r}"
        )
    if not isinstance(store_key, str) or not store_key:
        raise UserError(
            f"capture_activations: store_key must be a non-empty string, got {store_key!r}"
        )
    folder = check_output_dir(output_dir)

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        api = _tl_api("capture_activations")
        canonical = check_hooks(names, api.namespace)
        scope = sample_scope(state)
        check_specs(scope.specs, api.namespace)
        before = len(scope.records)
        scope.capturing = True
        try:
            state = await generate(state)
        finally:
            scope.capturing = False
        if len(scope.records) == before:
            raise UserError(
                "capture_activations: the model provider was not called for this sample, so "
                "nothing was captured: the response came from inspect's response cache. Turn "
                "the cache off for this eval (drop cache=True / --cache)"
            )
        record = scope.records[-1]
        prompt_len = len(record.prompt_ids)
        ids = [*record.prompt_ids, *record.generated_ids]
        _, captured = await api.forward_ids(
            ids, capture=canonical, specs=absolute_specs(record.specs, prompt_len)
        )
        summary = await anyio.to_thread.run_sync(
            _save, api, folder, state, captured, ids, prompt_len, record.specs, positions, reduce
        )
        state.store.set(store_key, summary)
        return state

    return solve


def _save(
    api: Any,
    folder: Any,
    state: TaskState,
    captured: dict[str, Any],
    ids: list[int],
    prompt_len: int,
    specs: Any,
    positions: Any,
    reduce: Any,
) -> dict[str, Any]:
    from tl_driver_inspect._store import reduce_and_select, sample_path, summarise, write_sample

    tensors = {
        name: reduce_and_select(
            t, api.namespace.layout(name), prompt_len=prompt_len, positions=positions, reduce=reduce
        )
        for name, t in captured.items()
    }
    path = sample_path(folder, state.sample_id, state.epoch)
    write_sample(
        path,
        tensors,
        ids,
        {
            "sample_id": str(state.sample_id),
            "epoch": state.epoch,
            "model": str(state.model),
            "n_prompt_tokens": prompt_len,
            "specs": specs or {},
            "positions": positions
            if positions is None or isinstance(positions, str)
            else list(positions),
            "reduce": reduce
            if reduce is None or isinstance(reduce, str)
            else getattr(reduce, "__name__", "callable"),
        },
    )
    return {
        "path": str(path),
        "n_tokens": len(ids),
        "n_prompt_tokens": prompt_len,
        "hooks": list(tensors),
        **summarise(tensors, reduced=reduce is not None),
    }
