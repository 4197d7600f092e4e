"""Eval logs with activation captures, as data frames and probe-ready tensors.

``capture_activations`` writes one safetensors file per sample and epoch and puts a JSON
summary in the sample's store. ``eval_dataframe`` reads those summaries next to the sample
ids, epochs and scores (through inspect's ``samples_df``); ``load_activations`` loads one
hook of the selected rows as one ``[n, d]`` batch with the matching scores, ready for a
probe.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch

from tl_core import UserError

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["eval_dataframe", "load_activations"]

#: Where ``capture_activations`` puts its summary by default.
DEFAULT_STORE_KEY = "tl_activations"

Position = Union[None, str, int]
#: The tensor of token ids in every file written by capture_activations (not a hook).
_TOKENS_KEY = "tokens"

_EXTRA_HINT = (
    "pip install 'tl-driver-inspect[analysis]' (inspect's samples_df needs pandas and "
    "pyarrow, which inspect-ai does not install)"
)


def eval_dataframe(
    log_or_path: Any,
    store_key: str = DEFAULT_STORE_KEY,
) -> pd.DataFrame:
    """One row per sample and epoch: id, epoch, scores and the activation summary.

    Args:
        log_or_path: An ``EvalLog``, a list of them, a ``.eval`` file, or a log folder
            (every log in it).
        store_key: The store key ``capture_activations`` wrote (its ``store_key``).

    Returns:
        A ``pandas.DataFrame`` with inspect's ``sample_id``, ``eval_id``, ``log``, ``id``,
        ``epoch``, ``target`` and ``score_<scorer>`` columns, then ``tl_file`` (absolute path
        of the sample's safetensors file), ``tl_tokens`` (tokens captured), ``tl_hooks``
        (hooks in the file), ``tl_shape.<hook>`` and ``tl_norm.<hook>`` per hook, and
        ``tl_summary`` (the whole summary as a dict). Rows without a summary have ``None``
        there.

    Raises:
        ImportError: pandas or pyarrow is missing (the message names the ``analysis`` extra).
        UserError: No sample of the logs has a summary under ``store_key``.
    """
    _require_frames()
    from inspect_ai.analysis import SampleColumn, SampleScores, SampleSummary, samples_df

    wanted = {"id", "epoch", "target", "error"}
    columns = [c for c in SampleSummary if c.name in wanted]
    columns += list(SampleScores[:1])  # score values ("score_<scorer>"), read from the full sample
    columns.append(SampleColumn("tl_summary", path=f"store.{store_key}", full=True))
    logs = os.fspath(log_or_path) if isinstance(log_or_path, os.PathLike) else log_or_path
    frame = samples_df(logs, columns=columns, quiet=True)
    summaries = [_parse(value) for value in frame["tl_summary"]]
    if not any(s is not None for s in summaries):
        raise UserError(
            f"no sample of {_describe(log_or_path)} has an activation summary under store key "
            f"{store_key!r}; run the eval with capture_activations(..., store_key={store_key!r}) "
            f"in its solvers (and without inspect's response cache, which skips the model)"
        )
    frame = frame.drop(columns=["tl_summary"])
    flat = [_flatten(s, log) for s, log in zip(summaries, frame["log"], strict=True)]
    keys = list(dict.fromkeys(k for row in flat for k in row))
    for key in keys:
        frame[key] = [row.get(key) for row in flat]
    frame["tl_summary"] = summaries
    return frame.sort_values(["id", "epoch"], kind="stable").reset_index(drop=True)


def load_activations(
    df_or_log: Any,
    hook: str,
    *,
    position: Position = None,
    samples: Any = None,
    score: str | None = None,
    store_key: str = DEFAULT_STORE_KEY,
) -> tuple[torch.Tensor, torch.Tensor, pd.DataFrame]:
    """One hook of the selected samples as a ``[n, d]`` batch, with their scores.

    Args:
        df_or_log: A frame from ``eval_dataframe``, or what it takes (a log, a ``.eval``
            file, a log folder).
        hook: A hook name (aliases resolve: ``blocks.3.hook_resid_post``).
        position: ``"last"`` (the last captured position), ``"mean"`` (over captured
            positions) or an int index into the captured positions (negative counts from
            the end). ``None`` (default): ``"last"``, or the file's one vector when
            ``capture_activations`` reduced at capture time (``reduce=...``); then only
            ``None`` or the same reduction is accepted.
        samples: Which rows: ``None`` (all with a summary), sample ids, ``(id, epoch)``
            pairs, or a boolean mask over the frame's rows.
        score: The score column (``"score_match"`` or ``"match"``); default: the first.
        store_key: As in ``eval_dataframe`` (used when a log is given).

    Returns:
        ``(X, y, frame)``: ``X`` float32 ``[n, d]`` (``d`` flattened for multi-axis hooks), ``y`` float32 ``[n]`` (scores as
        floats: ``C`` 1, ``I`` 0, ``P`` 0.5, numbers as they are), and the selected rows in
        the same order.

    Raises:
        UserError: No rows selected, a row without a file, a missing file, a hook the file
            does not hold (the message names the file and its hooks), a bad ``position``.
    """
    import pandas as pd

    frame = (
        df_or_log if isinstance(df_or_log, pd.DataFrame) else eval_dataframe(df_or_log, store_key)
    )
    if "tl_file" not in frame.columns:
        raise UserError(
            "the frame has no 'tl_file' column: build it with eval_dataframe(log) from an eval "
            "that ran capture_activations"
        )
    rows = _select(frame, samples)
    if rows.empty:
        raise UserError(f"no rows selected (samples={samples!r}) out of {len(frame)} in the frame")
    name = _canonical(hook)
    vectors = [_vector(row, name, hook, position) for _, row in rows.iterrows()]
    widths = {int(v.shape[0]) for v in vectors}
    if len(widths) != 1:
        raise UserError(
            f"hook {name!r} gives vectors of different widths across samples ({sorted(widths)}): "
            f"its feature axis depends on the sequence (attention patterns over keys); reduce it "
            f"first or pick a hook with a fixed width"
        )
    x = torch.stack(vectors).to(torch.float32)
    y = torch.tensor(_scores(rows, score), dtype=torch.float32)
    return x, y, rows.reset_index(drop=True)


# -- helpers ----------------------------------------------------------------------------


def _require_frames() -> None:
    missing = []
    for module in ("pandas", "pyarrow"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ImportError(f"eval_dataframe needs {' and '.join(missing)}: {_EXTRA_HINT}")


def _describe(log_or_path: Any) -> str:
    location = getattr(log_or_path, "location", None)
    if location:
        return f"log {location!r}"
    if isinstance(log_or_path, (str, os.PathLike)):
        return repr(os.fspath(log_or_path))
    return "the logs"


def _parse(value: Any) -> dict[str, Any] | None:
    """A store value as a dict (samples_df returns dicts as JSON strings)."""
    if not isinstance(value, (str, Mapping)) and _missing(value):
        return None
    if isinstance(value, str):
        if not value:
            return None
        value = json.loads(value)
    if not isinstance(value, Mapping):
        raise UserError(
            f"the store value of an activation summary is a {type(value).__name__}, expected a "
            f"dict written by capture_activations: {value!r:.200}"
        )
    return dict(value)


def _missing(value: Any) -> bool:
    """``None``, NaN or pandas' ``NA`` (what samples_df puts where a store has no key)."""
    import pandas as pd

    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _flatten(summary: Mapping[str, Any] | None, log: str) -> dict[str, Any]:
    if summary is None:
        return {"tl_file": None, "tl_tokens": None, "tl_prompt_tokens": None, "tl_hooks": None}
    row: dict[str, Any] = {
        "tl_file": _resolve_file(summary.get("path", summary.get("file")), log),
        "tl_tokens": summary.get("n_tokens"),
        "tl_prompt_tokens": summary.get("n_prompt_tokens"),
    }
    hooks = summary.get("hooks")
    shapes = summary.get("shapes", {})
    norms = summary.get("norms", {})
    if isinstance(hooks, Mapping):  # {"hook": {"shape": ..., "norm": ...}}
        shapes = {h: v.get("shape") for h, v in hooks.items() if isinstance(v, Mapping)}
        norms = {h: v.get("norm") for h, v in hooks.items() if isinstance(v, Mapping)}
    names = list(dict.fromkeys([*shapes, *norms])) if not isinstance(hooks, list) else list(hooks)
    row["tl_hooks"] = names
    for name in names:
        if name in shapes:
            row[f"tl_shape.{name}"] = shapes[name]
        if name in norms:
            row[f"tl_norm.{name}"] = norms[name]
    return row


def _resolve_file(path: Any, log: str) -> str | None:
    if not path:
        return None
    p = Path(str(path))
    if not p.is_absolute():
        p = Path(log).parent / p if log else p
    return os.fspath(p)


def _canonical(hook: str) -> str:
    from tl_core import HookNameError, canonical_name

    try:
        return canonical_name(hook)
    except HookNameError:
        return hook


def _layout(name: str) -> str:
    from tl_core import HookNameError
    from tl_core.driver_api import template_of

    try:
        return template_of(name).layout
    except HookNameError:
        return ""


def _select(frame: pd.DataFrame, samples: Any) -> pd.DataFrame:
    import pandas as pd

    has = frame["tl_file"].notna()
    if samples is None:
        return frame[has]
    if isinstance(samples, pd.Series) and samples.dtype == bool:
        return frame[samples.to_numpy() & has.to_numpy()]
    items = (
        list(samples)
        if isinstance(samples, Iterable) and not isinstance(samples, str)
        else [samples]
    )
    if items and all(isinstance(i, bool) for i in items):
        if len(items) != len(frame):
            raise UserError(f"a boolean mask needs {len(frame)} entries, got {len(items)}")
        return frame[[bool(i) for i in items]]
    picked = []
    for item in items:
        if isinstance(item, tuple):
            sid, epoch = item
            match = frame[(frame["id"].astype(str) == str(sid)) & (frame["epoch"] == int(epoch))]
        else:
            match = frame[frame["id"].astype(str) == str(item)]
        if match.empty:
            known = ", ".join(repr(i) for i in list(dict.fromkeys(frame["id"].astype(str)))[:8])
            raise UserError(f"no sample {item!r} in the frame (ids: {known}, ...)")
        picked.append(match)
    return pd.concat(picked)


def _vector(row: Any, name: str, asked: str, position: Position) -> torch.Tensor:
    from safetensors import safe_open

    path = row["tl_file"]
    where = f"sample {row['id']!r} epoch {row['epoch']}"
    if not isinstance(path, str) or not path:
        raise UserError(f"{where} has no activation file (no capture summary in its store)")
    if not os.path.exists(path):
        raise UserError(
            f"the activation file of {where} is missing: {path!r}. capture_activations wrote it "
            f"under its output_dir; move the folder back or rerun the eval"
        )
    with safe_open(path, framework="pt") as handle:
        keys = list(handle.keys())
        key = name if name in keys else asked if asked in keys else None
        if key is None:
            held = sorted(k for k in keys if k != _TOKENS_KEY)
            raise UserError(
                f"hook {asked!r} is not in {path!r} ({where}); the file holds {held}. Capture it "
                f"with capture_activations(hooks=[..., {asked!r}])"
            )
        tensor: torch.Tensor = handle.get_tensor(key)
        reduced = (handle.metadata() or {}).get("reduce")
    if reduced not in (None, "", "null"):
        if position not in (None, reduced):
            raise UserError(
                f"{key!r} in {path!r} was reduced at capture time (reduce={reduced!r}), so "
                f"position {position!r} cannot be taken from it; pass position=None"
            )
        return tensor.reshape(-1)
    if _layout(key) == "b h q k":  # [heads, query, key]: positions are queries
        tensor = tensor.transpose(0, 1)
    return _at(tensor, "last" if position is None else position, key, path)


def _at(tensor: torch.Tensor, position: Position, hook: str, path: str) -> torch.Tensor:
    """One position (or the mean) of a ``[pos, ...]`` capture, flattened to a vector."""
    if tensor.dim() < 2:
        raise UserError(f"{hook!r} in {path!r} has shape {tuple(tensor.shape)}: no position axis")
    if position == "last":
        return tensor[-1].reshape(-1)
    if position == "mean":
        return tensor.float().mean(0).reshape(-1)
    if isinstance(position, bool) or not isinstance(position, int):
        raise UserError(f"position must be None, 'last', 'mean' or an int, got {position!r}")
    n = int(tensor.shape[0])
    if not -n <= position < n:
        raise UserError(
            f"position {position} is out of range for {hook!r} in {path!r}: {n} positions captured"
        )
    return tensor[position].reshape(-1)


def _scores(rows: pd.DataFrame, score: str | None) -> list[float]:
    from inspect_ai.scorer import value_to_float

    columns = [c for c in rows.columns if c.startswith("score_")]
    if score is not None:
        name = score if score.startswith("score_") else f"score_{score}"
        if name not in columns:
            raise UserError(f"no score column {score!r}; the frame has {columns}")
    elif columns:
        name = columns[0]
    else:
        return [math.nan] * len(rows)
    to_float = value_to_float()
    out: list[float] = []
    for value in rows[name]:
        if _missing(value):
            out.append(math.nan)
        else:
            out.append(float(to_float(value)))
    return out
