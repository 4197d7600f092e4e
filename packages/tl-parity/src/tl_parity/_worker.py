"""One driver in its own process: boot, run the token ids, write the tensors to a file.

Run as ``python -m tl_parity._worker REQUEST.json``. The request names the driver, dtype,
options and a list of jobs (one model each). A reference job tokenises its prompts and
writes ``<out>.ids.json`` before its forward pass; a candidate job waits for that file
(``ids_from``), so both processes import and boot at the same time. Each job writes
``<out>.safetensors`` and ``<out>.json`` (``{"error": ..., "facts": ...}`` when it raised:
the facts say whether the driver refused the model at boot and whether it declares the
model's architecture, see ``tl_parity._declared``); a crash leaves no JSON and the parent
reports the exit code and the end of stderr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["main"]

_DTYPES = ("float32", "bfloat16", "float16")


class _BootFailed(Exception):
    """``tl_core.boot`` raised ``error``; ``facts`` say what that means for the report card."""

    def __init__(self, error: Exception, facts: dict[str, Any]) -> None:
        super().__init__(str(error))
        self.error = error
        self.facts = facts


def _boot_options(driver: str, dtype: str, options: dict[str, Any]) -> dict[str, Any]:
    import torch

    opts = dict(options)
    if "dtype" not in opts:
        if driver == "native":
            if dtype != "float32":
                opts["dtype"] = getattr(torch, dtype)
        elif driver == "inspect":
            if dtype != "float32":  # the providers load float32 unless told
                opts["dtype"] = dtype
        else:
            opts["dtype"] = dtype
    return opts


def _encode(bridge: Any, texts: list[str]) -> list[list[int]]:
    reads = getattr(bridge.driver, "signal_input", None)
    if reads is not None:
        from tl_core import UserError

        raise UserError(
            f"tl parity compares drivers on token ids, and this model reads {reads}, not "
            "text: compare its blocks from Python (run_with_cache on both bridges)"
        )
    tok = bridge.tokenizer
    bos = tok.bos_token_id
    n_ctx = int(getattr(bridge.driver.info, "n_ctx", 0) or 0)
    rows = []
    for text in texts:
        ids = [int(i) for i in tok.encode(text)]
        if bos is not None:
            ids = [int(bos), *ids]
        if n_ctx > 0:
            ids = ids[:n_ctx]
        rows.append(ids or [0])
    return rows


def _select(
    served: list[str],
    layers: list[int] | None,
    n_layers: int | None = None,
    model: str = "the model",
) -> list[str]:
    """The served names in the selected blocks, and every name outside the blocks.

    Raises:
        LayerRangeError: With ``n_layers`` known, a block the model does not have.
    """
    if layers is None:
        return served
    if n_layers is not None:
        from tl_parity._blocks import resolve_layers

        layers = resolve_layers(layers, n_layers, model)
    keep = set(layers)
    out = []
    for name in served:
        if name.startswith("blocks."):
            if int(name.split(".")[1]) in keep:
                out.append(name)
        else:
            out.append(name)
    return out


def _info_dict(info: Any) -> dict[str, Any] | None:
    if not dataclasses.is_dataclass(info):
        return None
    d: dict[str, Any] = {}
    for f in dataclasses.fields(info):
        value = getattr(info, f.name)
        if isinstance(value, (int, float, str, bool, type(None))):
            d[f.name] = value
        elif isinstance(value, (tuple, list)) and all(
            isinstance(v, (int, float, str)) for v in value
        ):
            d[f.name] = list(value)
    return d


def _wait_for(path: Path, timeout: float) -> dict[str, Any]:
    """The ids the reference wrote for one job (it writes them before running its forward)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no token ids from the reference after {timeout:.0f} s")
        time.sleep(0.05)
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(path)  # atomic: a reader never sees half a file


def run_job(request: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """Boot one model, run its ids, write the tensors; returns the metadata."""
    import torch
    from safetensors.torch import save_file

    import tl_core
    from tl_core.driver_api import run_keywords

    out = Path(job["out"])
    ids: list[list[int]] | None = None
    if "ids_from" in job:
        got = _wait_for(Path(job["ids_from"]), float(request.get("timeout", 600)))
        if "error" in got:
            raise RuntimeError(f"skipped: the reference failed ({got['error']})")
        ids = got["ids"]
    driver_name = request["driver"]
    dtype = request["dtype"]
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    opts = _boot_options(
        driver_name, dtype, {**(request.get("options") or {}), **(job.get("options") or {})}
    )
    try:
        bridge = tl_core.boot(job["model"], driver=driver_name, **opts)
    except Exception as exc:
        from tl_parity._declared import boot_failure_facts

        raise _BootFailed(
            exc,
            boot_failure_facts(
                exc, stage="boot", driver=driver_name, model=job["model"], options=opts
            ),
        ) from exc
    try:
        driver = bridge.driver
        namespace = driver.namespace
        served = [n for n in namespace.ordered if n in namespace.served]
        # Checked against the booted model: the parent could not always count its blocks.
        n_layers = getattr(driver.info, "n_layers", None)
        names = _select(
            served,
            request.get("layers"),
            n_layers if isinstance(n_layers, int) else None,
            job["model"],
        )
        if ids is None:
            ids = _encode(bridge, job["prompts"])
            _write(out.with_suffix(".ids.json"), {"ids": ids})
        result = run_keywords(driver, ids, capture=names, max_new_tokens=0, return_logits=True)
        tensors: dict[str, torch.Tensor] = {}
        for name, value in result.captured.items():
            tensors[f"hook::{name}"] = value.detach().to("cpu").clone().contiguous()
        if result.logits is not None:
            tensors["logits"] = result.logits.detach().to("cpu").clone().contiguous()
        lengths = list(result.lengths) or [len(r) for r in ids]
        save_file(tensors, str(out.with_suffix(".safetensors")))
        return {
            "ids": ids,
            "lengths": [int(n) for n in lengths],
            "requested": names,
            "layouts": {n: namespace.layout(n) for n in names},
            "non_fireable": dict(sorted(namespace.non_fireable_reasons.items())),
            "info": _info_dict(driver.info),
            "provides_sequence_logits": bool(driver.provides_sequence_logits),
        }
    finally:
        bridge.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the worker process: runs every job of the request; returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    request = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    for job in request["jobs"]:
        out = Path(job["out"])
        try:
            meta = run_job(request, job)
        except BaseException as exc:  # reported to the parent, which decides what it means
            cause = exc.error if isinstance(exc, _BootFailed) else exc
            error = f"{type(cause).__name__}: {cause}"
            if isinstance(exc, _BootFailed):
                facts = exc.facts
            else:
                from tl_parity._declared import boot_failure_facts

                facts = boot_failure_facts(
                    exc, stage="run", driver=request["driver"], model=job["model"]
                )
            if "ids_from" not in job and not out.with_suffix(".ids.json").exists():
                _write(out.with_suffix(".ids.json"), {"error": error})
            _write(
                out.with_suffix(".json"),
                {"error": error, "facts": facts, "traceback": traceback.format_exc(limit=8)},
            )
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            continue
        _write(out.with_suffix(".json"), meta)
    sys.stdout.flush()
    sys.stderr.flush()
    # Engines (vLLM) may leave non-daemon threads behind; the results are on disk already.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
