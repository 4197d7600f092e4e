"""The one message a run sends its workers: typed on both sides, plain data in between.

``collective_rpc`` carries plain data only (vLLM's msgpack RPC drops other objects), so the
driver builds a ``RunMessage``, sends ``to_wire()`` and every worker reads it back with
``RunMessage.from_wire``, which refuses a message of a version it does not know: a driver and
a worker from different tl-driver-vllm releases fail at the first run with both versions
named, not with a missing key in the middle of a forward pass.

Edits arrive compiled and stacked: per hook, one ``[rows, width]`` table of ``x * scale +
bias`` rows for the whole run, and per request the first row of its part (prompts with the
same specs share their rows). A worker only slices its tensor-parallel columns and casts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from tl_core import TLError
from tl_driver_vllm._wire import pack, unpack

__all__ = ["EditRows", "RequestEntry", "RunMessage", "StackedEdits"]


@dataclass(frozen=True)
class EditRows:
    """Where one request's rows start in a hook's stacked table, and what they cover.

    Attributes:
        first: The request's first row.
        positional: One row per prompt position, then one for generated tokens; else one
            row for every prompt position, then one for generated tokens.
    """

    first: int
    positional: bool


@dataclass(frozen=True)
class RequestEntry:
    """What one request of the run asks for.

    Attributes:
        tag: The run-local id the request's ``SamplingParams`` carry.
        index: Its row in the run's batch (its place in the driver's prompt list).
        length: Its prompt's length.
        capture: Canonical hooks captured at its prompt positions.
        logits: ``False``, ``True`` (every prompt position) or ``"last"``.
        edits: Hook -> its rows in that hook's stacked table.
    """

    tag: str
    index: int
    length: int
    capture: tuple[str, ...] = ()
    logits: bool | Literal["last"] = False
    edits: Mapping[str, EditRows] = field(default_factory=dict)


@dataclass(frozen=True)
class StackedEdits:
    """Every request's edit rows for one hook: row ``i`` is ``x * scale[i] + bias[i]``.

    Attributes:
        scale: ``[rows, prod(feature_shape)]`` float32, head-major on head sites.
        bias: Same shape.
    """

    scale: torch.Tensor
    bias: torch.Tensor


@dataclass(frozen=True)
class RunMessage:
    """One run, as the driver describes it to its workers.

    Attributes:
        requests: Every request of the run.
        tables: Hook -> the run's stacked edit rows on it.
        width: The longest prompt (captures come back ``[batch, width, ...]``).
        raw: The workers run in the driver's process: tensors travel as they are.
        all_ranks: Every rank returns its results (the driver checks ranks agree once).
        shared: The driver's shared-memory offer (``_wire.SharedFiles.offer``) or ``None``.
    """

    VERSION: ClassVar[int] = 1

    requests: tuple[RequestEntry, ...]
    tables: Mapping[str, StackedEdits] = field(default_factory=dict)
    width: int = 0
    raw: bool = False
    all_ranks: bool = False
    shared: Mapping[str, str] | None = None

    def to_wire(self) -> dict[str, Any]:
        """Plain data for ``collective_rpc`` (tensors packed unless ``raw``)."""
        return {
            "version": self.VERSION,
            "requests": [
                {
                    "tag": r.tag,
                    "index": r.index,
                    "length": r.length,
                    "capture": list(r.capture),
                    "logits": r.logits,
                    "edits": {h: [e.first, e.positional] for h, e in r.edits.items()},
                }
                for r in self.requests
            ],
            "tables": {
                hook: {"scale": pack(t.scale, raw=self.raw), "bias": pack(t.bias, raw=self.raw)}
                for hook, t in self.tables.items()
            },
            "width": self.width,
            "raw": self.raw,
            "all_ranks": self.all_ranks,
            "shared": dict(self.shared) if self.shared is not None else None,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> RunMessage:
        """Read a message ``to_wire`` made.

        Raises:
            TLError: A message of another version (the driver and this worker run
                different tl-driver-vllm releases), naming both versions.
        """
        version = data.get("version") if isinstance(data, Mapping) else None
        if version != cls.VERSION:
            raise TLError(
                f"a vLLM worker got a run message of version {version!r} and reads version "
                f"{cls.VERSION} only: the driver and the engine's workers run different "
                "tl-driver-vllm releases; install one release everywhere the engine runs"
            )
        requests = tuple(
            RequestEntry(
                tag=str(r["tag"]),
                index=int(r["index"]),
                length=int(r["length"]),
                capture=tuple(r["capture"]),
                logits="last" if r["logits"] == "last" else bool(r["logits"]),
                edits={h: EditRows(int(e[0]), bool(e[1])) for h, e in r["edits"].items()},
            )
            for r in data["requests"]
        )
        tables = {
            hook: StackedEdits(unpack(t["scale"]), unpack(t["bias"]))
            for hook, t in data["tables"].items()
        }
        shared = data.get("shared")
        return cls(
            requests,
            tables,
            width=int(data["width"]),
            raw=bool(data["raw"]),
            all_ranks=bool(data["all_ranks"]),
            shared=dict(shared) if shared is not None else None,
        )
