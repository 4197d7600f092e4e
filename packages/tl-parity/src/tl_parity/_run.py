"""``run_parity``: both drivers in their own processes, then the hook-by-hook comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tl_parity._blocks import LayerRangeError, declared_blocks, layers_text, resolve_layers
from tl_parity._checks import check_driver, check_model
from tl_parity._compare import argmax_agreement, compare, reference_mapping
from tl_parity._tolerance import band_for
from tl_parity._types import HookComparison, ParityReport

__all__ = [
    "DEFAULT_PROMPTS",
    "LayerRangeError",
    "Progress",
    "WorkerError",
    "WorkerFailure",
    "run_parity",
    "run_parity_many",
    "run_workers",
]

#: A ragged batch: different lengths exercise padding, masks and per-prompt splitting.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "In 1905 Albert Einstein published four papers that changed physics, and",
    "def add(a, b):\n    return a + b",
)

#: How a driver process starts (tests swap it for one that crashes).
WORKER_COMMAND: tuple[str, ...] = (sys.executable, "-m", "tl_parity._worker")

#: Seconds one driver process may run before it counts as hung.
WORKER_TIMEOUT_S = 600.0


class WorkerError(RuntimeError):
    """A driver process failed: it raised (message from the process) or crashed.

    Attributes:
        facts: What the process reported about the failure (``tl_parity._declared``):
            empty when it crashed or timed out.
    """

    def __init__(self, message: str, facts: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.facts: dict[str, Any] = dict(facts or {})


@dataclass(frozen=True)
class WorkerFailure:
    """Why one job has no result.

    Attributes:
        message: Starts with ``"reference"``, ``"candidate"`` or ``"timeout"``.
        side: ``"reference"`` or ``"candidate"``; ``None`` for a timeout of both.
        facts: What the failing process reported (stage, error types, whether the driver
            refused the model's architecture and whether it declares it).
    """

    message: str
    side: str | None = None
    facts: Mapping[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


class Progress:
    """A one-line progress display on stderr (nothing when ``quiet``)."""

    def __init__(self, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self._t0 = time.monotonic()

    def step(self, message: str) -> None:
        """Show ``message`` with the elapsed time."""
        if not self.quiet:
            print(
                f"[tl parity {time.monotonic() - self._t0:5.1f}s] {message}",
                file=self.stream,
                flush=True,
            )


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # vLLM's engine in the worker process itself: no engine-core subprocess to orphan.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("INSPECT_EVAL_CTL_SERVER", "false")
    return env


class _Worker:
    """One driver process running a list of jobs; stderr goes to a file (no pipe to fill)."""

    def __init__(self, request: dict[str, Any], workdir: Path, tag: str) -> None:
        self.driver = request["driver"]
        self.tag = tag
        self.stderr_path = workdir / f"{tag}.stderr"
        req_path = workdir / f"{tag}-request.json"
        req_path.write_text(json.dumps(request), encoding="utf-8")
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [*WORKER_COMMAND, str(req_path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=_worker_env(),
            )

    def died(self) -> str:
        """Why the process ended without results: exit code and the end of its stderr."""
        lines = self.stderr_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        tail = [ln.strip() for ln in lines if ln.strip()][-4:]
        return f"the {self.driver!r} process died with exit code {self.proc.returncode}" + (
            ": " + " | ".join(tail) if tail else ""
        )

    def kill(self) -> None:
        """Stop the process if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _result(out: Path, worker: _Worker) -> tuple[dict[str, Any], dict[str, Any]]:
    from safetensors.torch import load_file

    meta_path = out.with_suffix(".json")
    if not meta_path.exists():
        raise WorkerError(worker.died())
    meta: dict[str, Any] = json.loads(meta_path.read_text(encoding="utf-8"))
    if "error" in meta:
        raise WorkerError(meta["error"], meta.get("facts"))
    return meta, dict(load_file(str(out.with_suffix(".safetensors"))))


Outcome = tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]


def run_workers(
    reference: dict[str, Any],
    candidate: dict[str, Any],
    jobs: Sequence[dict[str, Any]],
    workdir: Path,
    timeout: float = WORKER_TIMEOUT_S,
) -> list[Outcome | WorkerFailure]:
    """Run the reference and candidate processes side by side over ``jobs``.

    ``reference``/``candidate`` hold ``driver``, ``dtype``, ``options`` and ``layers``;
    each job holds ``model`` and ``prompts`` (and optional per-job ``options`` under
    ``reference_options``/``candidate_options``). Both processes start at once: the
    candidate imports and boots while the reference runs, then waits for its token ids.

    Returns:
        Per job, ``(ref_meta, ref_tensors, cand_meta, cand_tensors)`` or a ``WorkerFailure``
        whose message starts with ``"reference"``, ``"candidate"`` or ``"timeout"``.
    """
    ref_jobs, cand_jobs = [], []
    for i, job in enumerate(jobs):
        ref_out, cand_out = workdir / f"ref{i}", workdir / f"cand{i}"
        ref_jobs.append(
            {
                "model": job["model"],
                "prompts": job["prompts"],
                "out": str(ref_out),
                "options": job.get("reference_options") or {},
            }
        )
        cand_jobs.append(
            {
                "model": job["model"],
                "ids_from": str(ref_out.with_suffix(".ids.json")),
                "out": str(cand_out),
                "options": job.get("candidate_options") or {},
            }
        )
    ref = _Worker({**reference, "jobs": ref_jobs, "timeout": timeout}, workdir, "reference")
    cand = _Worker({**candidate, "jobs": cand_jobs, "timeout": timeout}, workdir, "candidate")
    deadline = time.monotonic() + timeout * max(1, len(jobs))
    try:
        while ref.proc.poll() is None or cand.proc.poll() is None:
            if ref.proc.poll() is not None:
                # A reference that died leaves the candidate waiting: tell it, job by job.
                for job in ref_jobs:
                    ids_path = Path(job["out"]).with_suffix(".ids.json")
                    if not ids_path.exists():
                        ids_path.write_text(json.dumps({"error": ref.died()}), encoding="utf-8")
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"the driver processes did not finish within {timeout:.0f} s per model"
                )
            time.sleep(0.05)
    except WorkerError as exc:
        ref.kill()
        cand.kill()
        return [WorkerFailure(f"timeout: {exc}")] * len(jobs)
    finally:
        ref.kill()
        cand.kill()
    outcomes: list[Outcome | WorkerFailure] = []
    for rj, cj in zip(ref_jobs, cand_jobs, strict=False):
        try:
            ref_meta, ref_t = _result(Path(rj["out"]), ref)
        except WorkerError as exc:
            outcomes.append(
                WorkerFailure(
                    f"reference {reference['driver']!r} failed: {exc}", "reference", exc.facts
                )
            )
            continue
        try:
            cand_meta, cand_t = _result(Path(cj["out"]), cand)
        except WorkerError as exc:
            outcomes.append(
                WorkerFailure(
                    f"candidate {candidate['driver']!r} failed: {exc}", "candidate", exc.facts
                )
            )
            continue
        outcomes.append((ref_meta, ref_t, cand_meta, cand_t))
    return outcomes


def _layers(layers: str | Sequence[int] | None) -> list[int] | None:
    if layers is None or layers == "all":
        return None
    if isinstance(layers, str):
        try:
            return sorted({int(x) for x in layers.split(",") if x.strip()})
        except ValueError:
            raise ValueError(
                f"layers must be 'all' or comma-separated block indices, got {layers!r}"
            ) from None
    return sorted({int(x) for x in layers})


def _check_layers(
    models: Sequence[Any], layers: list[int], drivers: Sequence[tuple[str, Mapping[str, Any]]]
) -> None:
    """Refuse blocks a model lacks, wherever its block count is known without booting it."""
    for model in models:
        for driver, options in drivers:
            n_blocks = declared_blocks(str(model), driver, options)
            if n_blocks is not None:
                resolve_layers(layers, n_blocks, str(model))


def _no_block_compared(layers: list[int], ref_meta: Mapping[str, Any]) -> str:
    n_blocks = (ref_meta.get("info") or {}).get("n_layers")
    count = f"{n_blocks} blocks" if isinstance(n_blocks, int) else "an unknown number of blocks"
    return (
        f"layers {layers_text(layers)!r} selected no block hook to compare (the model has {count}), "
        f"so the run checked nothing in the blocks; choose blocks the candidate serves or use 'all'"
    )


def _read_prompts(prompts: str | os.PathLike[str] | Sequence[str] | None) -> list[str]:
    if prompts is None:
        return list(DEFAULT_PROMPTS)
    if isinstance(prompts, (str, os.PathLike)):
        if not Path(prompts).is_file():
            raise ValueError(
                f"prompts file {str(prompts)!r} does not exist or is not a file; pass a "
                f"text file with one prompt a line, or leave prompts out for the built-in batch"
            )
        lines = [ln for ln in Path(prompts).read_text(encoding="utf-8").splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"prompts file {str(prompts)!r} has no non-empty lines")
        return lines
    return list(prompts)


def _model_info(d: Mapping[str, Any] | None) -> Any:
    if not d:
        return None
    try:
        import dataclasses

        from tl_core.hooks import ModelInfo

        names = {f.name for f in dataclasses.fields(ModelInfo)}
        return ModelInfo(**{k: v for k, v in d.items() if k in names and k != "device"})
    except Exception:  # the diagnostics then work without it
        return None


def _diagnose(
    hook: str, cand: Any, ref: Mapping[str, Any], info: Any, lengths: Sequence[int]
) -> str | None:
    try:
        from tl_parity import _diagnose as diag  # P2's module; optional
    except ImportError:
        return None
    try:
        result: str | None = diag.diagnose(hook, cand, ref, info, lengths=lengths)
        return result
    except Exception as exc:  # a diagnostic must never hide the row it explains
        return f"(diagnosis failed: {type(exc).__name__}: {exc})"


def run_parity(
    model: Any,
    *,
    candidate: str,
    reference: str = "hf",
    dtype: str = "float32",
    prompts: str | os.PathLike[str] | Sequence[str] | None = None,
    layers: str | Sequence[int] | None = "all",
    candidate_options: Mapping[str, Any] | None = None,
    reference_options: Mapping[str, Any] | None = None,
    quiet: bool = False,
    progress: Progress | None = None,
) -> ParityReport:
    """Run the same token ids through ``reference`` and ``candidate`` and compare every hook.

    Each driver runs in its own process (``python -m tl_parity._worker``) and sends its
    tensors back through a temporary safetensors file, so a crashing engine ends up in
    ``report.error`` instead of taking the caller down. The reference tokenises the prompts
    (with BOS); the candidate gets exactly those ids. ``candidate == reference`` is allowed
    and is a determinism check in the same-engine band (the native driver's only mode, as
    it loads no checkpoints).

    Args:
        model: What both drivers load: a checkpoint folder or hub id (a preset for native).
        candidate: The driver under test (a name from ``tl drivers``).
        reference: The driver whose numbers count as right (default ``hf``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``; chooses the tolerance band.
        prompts: Texts, a file with one prompt a line, or ``None`` for a built-in ragged batch.
        layers: ``"all"``, ``"0,1"`` or a list of block indices (``-1`` is the last block);
            hooks outside blocks are always compared. A selection that compares no block
            hook is an error, never a pass.
        candidate_options: Boot options of the candidate (JSON-serialisable).
        reference_options: Boot options of the reference (JSON-serialisable).
        quiet: No progress lines on stderr.
        progress: A progress display to reuse (overrides ``quiet``).

    Returns:
        The report; ``report.error`` is set when a driver failed and the rows are then empty.

    Raises:
        ValueError: A bad ``dtype``, ``layers`` or prompts file, or a model spelled as a
            path that does not exist (a ``UserError``).
        DriverNotFoundError: ``candidate`` or ``reference`` is not installed (a
            ``ValueError``; the message names the closest installed driver or the
            ``pip install`` line).
        DriverLoadError: A driver that is broken, or whose engine is missing or outside
            its tested range (``EngineVersionError``).
        LayerRangeError: ``layers`` names a block the model does not have (a
            ``ValueError``), when the block count is known without booting; otherwise
            the driver process reports it in ``report.error``.

    Every check above is made before any driver process starts.
    """
    return run_parity_many(
        [model],
        candidate=candidate,
        reference=reference,
        dtype=dtype,
        prompts=prompts,
        layers=layers,
        candidate_options=candidate_options,
        reference_options=reference_options,
        quiet=quiet,
        progress=progress,
    )[0]


def run_parity_many(
    models: Sequence[Any],
    *,
    candidate: str,
    reference: str = "hf",
    dtype: str = "float32",
    prompts: str | os.PathLike[str] | Sequence[str] | None = None,
    layers: str | Sequence[int] | None = "all",
    candidate_options: Mapping[str, Any] | None = None,
    reference_options: Mapping[str, Any] | None = None,
    quiet: bool = False,
    progress: Progress | None = None,
) -> list[ParityReport]:
    """``run_parity`` over several models with one process per driver (imports paid once).

    A model whose boot or forward raises gets a report with ``error`` set; the others
    still run. A crashing process errors every model it had not finished.

    Returns:
        One report per model, in order.

    Raises:
        ValueError: As ``run_parity``; the drivers, every model's path and ``layers`` are
            checked before any driver process starts.
        DriverLoadError: As ``run_parity``.
    """
    show = progress if progress is not None else Progress(quiet=quiet)
    check_driver(reference, "reference")
    if candidate != reference:
        check_driver(candidate, "candidate")
    for model in models:
        check_model(model)
    layer_list = _layers(layers)
    if layer_list is not None:
        _check_layers(
            models,
            layer_list,
            [(reference, reference_options or {}), (candidate, candidate_options or {})],
        )
    texts = _read_prompts(prompts)
    band = band_for(dtype, reference, candidate, reference_options, candidate_options)
    common = {"dtype": dtype, "layers": layer_list}
    jobs = [{"model": str(m), "prompts": texts} for m in models]
    show.step(
        f"{reference!r} (reference) and {candidate!r} (candidate): booting, "
        f"{len(models)} model(s), {len(texts)} prompts"
    )
    with tempfile.TemporaryDirectory(prefix="tl-parity-") as tmp:
        outcomes = run_workers(
            {**common, "driver": reference, "options": dict(reference_options or {})},
            {**common, "driver": candidate, "options": dict(candidate_options or {})},
            jobs,
            Path(tmp),
        )
    reports = []
    for model, outcome in zip(models, outcomes, strict=False):
        report = ParityReport(
            model=str(model),
            reference=reference,
            candidate=candidate,
            dtype=dtype,
            hooks=[],
            logits=None,
            argmax_agreement=None,
            non_fireable={},
        )
        if isinstance(outcome, (WorkerFailure, str)):
            report.error = str(outcome)
            if isinstance(outcome, WorkerFailure) and outcome.side is not None:
                report.extra = {"failure": {"side": outcome.side, **outcome.facts}}
            show.step(f"{model}: {outcome}")
        else:
            _fill(report, *outcome, band=band, n_prompts=len(texts))
            if layer_list is not None and not any(row.layer is not None for row in report.hooks):
                report.error = _no_block_compared(layer_list, outcome[0])
            failed = len(report.failures)
            show.step(
                f"{model}: {len(report.hooks)} hooks compared, "
                + ("all pass" if report.passed else f"{failed} rows not PASS")
            )
        reports.append(report)
    return reports


def _fill(
    report: ParityReport,
    ref_meta: dict[str, Any],
    ref_t: dict[str, Any],
    cand_meta: dict[str, Any],
    cand_t: dict[str, Any],
    *,
    band: Any,
    n_prompts: int,
) -> None:
    lengths = ref_meta["lengths"]
    ref_hooks = reference_mapping(ref_t)
    cand_hooks = reference_mapping(cand_t)
    info = _model_info(ref_meta.get("info"))
    rows: list[HookComparison] = []
    for name in cand_meta["requested"]:
        row = compare(
            name,
            cand_hooks.get(name),
            ref_hooks.get(name),
            layout=cand_meta["layouts"][name],
            lengths=lengths,
            band=band,
        )
        if row.status == "FAIL" and name in cand_hooks:
            diag = _diagnose(name, cand_hooks[name], ref_hooks, info, lengths)
            if diag:
                row = _with_diagnostic(row, diag)
        rows.append(row)
    report.hooks = rows
    report.non_fireable = dict(cand_meta["non_fireable"])
    if "logits" in cand_t and "logits" in ref_t:
        report.logits = compare(
            "logits", cand_t["logits"], ref_t["logits"], layout="b p v", lengths=lengths, band=band
        )
        report.argmax_agreement = argmax_agreement(cand_t["logits"], ref_t["logits"], lengths)
    report.extra = {
        "lengths": lengths,
        "n_prompts": n_prompts,
        "candidate_sequence_logits": cand_meta.get("provides_sequence_logits"),
    }


def _with_diagnostic(row: HookComparison, diagnostic: str) -> HookComparison:
    import dataclasses

    return dataclasses.replace(row, diagnostic=diagnostic)
