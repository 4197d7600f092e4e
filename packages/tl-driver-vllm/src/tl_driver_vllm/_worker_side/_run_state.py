"""Worker side: one run's requests, their edit tables and captures, and each step's layout.

vLLM hands every forward step a flat ``[tokens, d]`` batch whose rows belong to whichever
requests the scheduler picked, in its own order, possibly as a chunk of a longer prompt.
``Step`` maps rows to (request, prompt position) from the model runner's own bookkeeping
(request ids, query start offsets, computed-token counts) — never from list positions — so
captures and edits land on the right request whatever the scheduler does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tl_core import TLError
from tl_core.driver_api import Attachment, DictionaryRun
from tl_driver_vllm._run_message import RunMessage

__all__ = ["NORMED", "Allocate", "RequestPlan", "RunState", "Step", "copy_rows"]

#: Internal capture of the final norm's output, from which logits are computed.
NORMED = "__normed__"


#: ``(shape, dtype, device) -> tensor``: where a run's result buffers are made (``_wire.Outbox``).
Allocate = Callable[[Sequence[int], torch.dtype, torch.device], torch.Tensor]


def _empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=device)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for tensors of one dtype; on the CPU as one single-threaded copy.

    torch's CPU copy hands every large copy to its OpenMP threads, and on a busy machine
    (engine threads, other jobs) that hand-off costs far more than the copy: a captured
    site would cost milliseconds per step. numpy copies the same bits (strided source
    included) on the calling thread.
    """
    bits = _BITS.get(src.element_size())
    if src.device.type != "cpu" or dst.dtype != src.dtype or bits is None or src.dtype.is_complex:
        dst.copy_(src)
        return
    dst.view(bits).numpy()[...] = src.view(bits).numpy()


@dataclass
class RequestPlan:
    """What one request asks for: captures, logits and per-hook edit table offsets.

    ``capture`` is what the sites record for it, ``returned`` what goes back to the driver:
    a rebuilt attention pattern records the queries and keys it is built from, which are
    returned only when asked for too.
    """

    tag: str
    length: int
    capture: frozenset[str]
    #: ``False``, ``True`` (every prompt position) or ``"last"`` (the last one only).
    logits: bool | str
    #: hook -> (first row in that hook's stacked table, whether rows follow positions)
    edits: dict[str, tuple[int, bool]] = field(default_factory=dict)
    returned: frozenset[str] = frozenset()
    #: The request's row in the run's batch (its place in the driver's prompt list).
    index: int = 0


@dataclass
class EditTable:
    """All requests' edit rows for one hook, stacked: ``x * scale[i] + bias[i]``."""

    scale: torch.Tensor
    bias: torch.Tensor
    zero: torch.Tensor | None


class RunState:
    """Everything a run needs inside one worker.

    Args:
        message: The run as the driver describes it (``RunMessage.from_wire``).
        device: The worker's device.
        dtype: The model's dtype (edit tables are cast to it).
        columns: Per sharded hook, the columns of its (flattened, full-width) edit table
            that this tensor-parallel rank holds; other hooks use the whole table.
        needs: Per hook, the hooks its value is rebuilt from (recorded, not returned).
        allocate: Makes the ``[batch, width, ...]`` buffers (default: ``torch.empty``);
            the worker passes its ``Outbox``, so captures land where they are sent from.
        dictionaries: The dictionaries attached to the model (canonical site -> attachment);
            each runs at its site on every row of every step.
    """

    def __init__(
        self,
        message: RunMessage,
        device: torch.device,
        dtype: torch.dtype,
        *,
        columns: Mapping[str, slice] | None = None,
        needs: Mapping[str, tuple[str, ...]] | None = None,
        allocate: Allocate | None = None,
        dictionaries: Mapping[str, Attachment] | None = None,
    ) -> None:
        self.allocate: Allocate = allocate or _empty
        #: Each dictionary's run by the site it reads, and transcoders' by the site they write.
        self.readers = {hook: self._run_of(a) for hook, a in (dictionaries or {}).items()}
        self.writers = {
            r.attachment.site.output_hook: r
            for r in self.readers.values()
            if r.attachment.site.output_hook != r.attachment.site.hook
        }
        columns = columns or {}
        needs = needs or {}
        self.raw = message.raw
        self.all_ranks = message.all_ranks
        self.plans: dict[str, RequestPlan] = {}
        for request in message.requests:
            wanted = frozenset(request.capture)
            plan = RequestPlan(
                request.tag, request.length, wanted, request.logits, returned=wanted,
                index=request.index,
                edits={h: (e.first, e.positional) for h, e in request.edits.items()},
            )  # fmt: skip
            plan.capture = wanted | {n for name in wanted for n in needs.get(name, ())}
            if plan.logits or "unembed.hook_out" in plan.capture:
                plan.capture = plan.capture | {NORMED}
            self.plans[request.tag] = plan
        self.tables: dict[str, EditTable] = {}
        for hook, table in message.tables.items():
            scale, bias = table.scale, table.bias
            if hook in columns:  # this tensor-parallel rank's heads or neurons
                scale, bias = scale[:, columns[hook]], bias[:, columns[hook]]
            scale = scale.to(device=device, dtype=dtype)
            bias = bias.to(device=device, dtype=dtype)
            zero = scale == 0
            self.tables[hook] = EditTable(scale, bias, zero if bool(zero.any()) else None)
        self.captured = {name for plan in self.plans.values() for name in plan.capture}
        self.batch = max((plan.index for plan in self.plans.values()), default=-1) + 1
        self.width = message.width or max((p.length for p in self.plans.values()), default=0)
        #: hook -> ``[batch, width, ...]``: every request's prompt rows at their final place
        #: (written once, straight from the engine's tensors; no per-prompt pieces to join).
        self.buffers: dict[str, torch.Tensor] = {}
        self.written: dict[tuple[str, str], int] = {}
        self.square: set[str] = set()
        self.step: Step | None = None
        self.tag_of: dict[str, str | None] = {}

    def needed(self) -> set[str]:
        """Every hook name some request captures or edits, and every dictionary's sites."""
        return self.captured | set(self.tables) | set(self.readers) | set(self.writers)

    # -- per-site work -----------------------------------------------------------------

    def visit(self, names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor:
        """Apply edits then captures of ``names`` in order; returns ``x`` or an edited copy."""
        step = self.step
        if step is None or not step.entries:
            return x
        for name in names:
            if name in self.tables:
                x = self._edit(name, x, step)
            if name in self.captured:
                self.capture(name, x)
            if name in self.readers:
                x = self.readers[name].read(x)
            if name in self.writers:
                x = self.writers[name].write(x)
        return x

    def _run_of(self, attachment: Attachment) -> DictionaryRun:
        """A dictionary's run at its sites: its own sites fire through ``visit`` (edit
        tables, capture buffers); captures are copies, so it may work in place."""
        site = attachment.site
        top = (site.name("hook_sae_top_indices"), site.name("hook_sae_top_values"))

        def visit(short: str, value: torch.Tensor) -> torch.Tensor:
            return self.visit((site.name(short),), value)

        return DictionaryRun(
            attachment, visit, lambda: any(n in self.captured for n in top), copies=True
        )

    def capture(
        self,
        name: str,
        x: torch.Tensor,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Store the prompt rows of ``x`` for every request that captures ``name``."""
        step = self.step
        if step is None:
            return
        rows, segments = step.capture_rows(name, self.plans)
        if not segments:
            return
        # A slice is a view: each segment is copied once, into its request's row.
        taken = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
        if transform is not None:
            taken = transform(taken)
        buffer = self.buffers.get(name)
        if buffer is None:
            # A normal tensor, though the engine runs under inference mode: callers may
            # edit what they get back in place.
            with torch.inference_mode(False):
                buffer = self.allocate(
                    (self.batch, self.width, *taken.shape[1:]), taken.dtype, taken.device
                )
            self.buffers[name] = buffer
        # Segments that sit end to end in the flat buffer (whole prompts in batch order, the
        # usual prefill) go in one copy: each torch op costs a thread hand-off on the CPU.
        flat = buffer.view(self.batch * self.width, *buffer.shape[2:])
        offset = 0
        run_start, run_rows = -1, 0
        for tag, first, count in segments:
            at = self.plans[tag].index * self.width + first
            if run_rows and at != run_start + run_rows:
                copy_rows(flat[run_start : run_start + run_rows], taken[offset - run_rows : offset])
                run_rows = 0
            if not run_rows:
                run_start = at
            run_rows += count
            offset += count
            self.written[(name, tag)] = self.written.get((name, tag), 0) + count
        copy_rows(flat[run_start : run_start + run_rows], taken[offset - run_rows : offset])

    def set_batched(self, name: str, value: torch.Tensor) -> None:
        """Store a hook computed after the run for the whole batch (a rebuilt pattern,
        ``[batch, heads, width, width]``, already filled past each prompt's end)."""
        self.buffers[name] = value
        self.square.add(name)
        for plan in self.plans.values():
            self.written[(name, plan.tag)] = plan.length

    def _edit(self, name: str, x: torch.Tensor, step: Step) -> torch.Tensor:
        rows, index = step.edit_rows(name, self.plans, x.device)
        if rows is None:
            return x
        table = self.tables[name]
        scale, bias = table.scale.index_select(0, index), table.bias.index_select(0, index)
        sub = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
        # Tables are flat [rows, features]; head sites arrive as [tokens, heads, d_head].
        new = torch.addcmul(bias, sub.reshape(sub.shape[0], -1), scale)
        if table.zero is not None:
            new = torch.where(table.zero.index_select(0, index), bias, new)
        new = new.view(sub.shape)
        if isinstance(rows, slice) and rows.start == 0 and rows.stop == x.shape[0]:
            return new
        out = x.clone()
        if isinstance(rows, slice):
            out[rows] = new
        else:
            out.index_copy_(0, rows, new)
        return out

    # -- collection --------------------------------------------------------------------

    def check_written(self) -> None:
        """Make sure every captured hook holds every position of every prompt.

        Raises:
            TLError: Some prompt positions were not computed (nothing else skips them).
        """
        for name in self.buffers:
            for plan in self.plans.values():
                if name in plan.capture:
                    self._check_written(name, plan)

    def batched(self, name: str) -> torch.Tensor:
        """Hook ``name`` for the whole batch, ``[batch, width, ...]``, zero-padded.

        Raises:
            TLError: ``name`` never fired in this run (its site was not reached).
        """
        buffer = self.buffers.get(name)
        if buffer is None:
            raise TLError(
                f"hook {name!r} never fired in this run, so nothing can be returned or "
                "rebuilt from it: the engine's forward did not reach its site (a module "
                "the family's layout names wrongly, or a compiled graph traced without "
                "tl's hooks). Boot with certify=True to see which hooks fire."
            )
        if name in self.square:
            return buffer  # allocated filled: only each prompt's own square was written
        for plan in self.plans.values():
            if name not in plan.capture:
                buffer[plan.index] = 0
            elif plan.length < self.width:
                buffer[plan.index, plan.length :] = 0
        return buffer

    def _check_written(self, name: str, plan: RequestPlan) -> None:
        got = self.written.get((name, plan.tag), 0)
        if got != plan.length:
            raise TLError(
                f"prompt {plan.index}: the engine computed {got} of its {plan.length} positions "
                f"for {name!r}; some positions were not recomputed (prefix caching?)"
            )


class Step:
    """Which rows of one forward step belong to which tracked request, at which position.

    Args:
        entries: ``(plan, first row, row count, position of the first row)`` per tracked
            request scheduled in this step.
        device: Where index tensors go.
    """

    def __init__(
        self, entries: list[tuple[RequestPlan, int, int, int]], device: torch.device
    ) -> None:
        self.entries = entries
        self.device = device
        self._capture: dict[str, tuple[Any, list[tuple[str, int, int]]]] = {}
        self._edit: dict[str, tuple[Any, torch.Tensor | None]] = {}

    def capture_rows(
        self, name: str, plans: dict[str, RequestPlan]
    ) -> tuple[Any, list[tuple[str, int, int]]]:
        """Rows to keep for ``name`` (a slice or index tensor) and their segments."""
        if name in self._capture:
            return self._capture[name]
        segments: list[tuple[str, int, int]] = []
        starts: list[int] = []
        for plan, row, count, first in self.entries:
            keep = min(count, plan.length - first)
            if name in plan.capture and keep > 0:
                segments.append((plan.tag, first, keep))
                starts.append(row)
        rows = self._rows(starts, [n for _, _, n in segments])
        self._capture[name] = (rows, segments)
        return rows, segments

    def edit_rows(
        self, name: str, plans: dict[str, RequestPlan], device: torch.device
    ) -> tuple[Any, torch.Tensor]:
        """Rows an edit of ``name`` touches and, per row, its row in the edit table."""
        if name in self._edit:
            return self._edit[name]  # type: ignore[return-value]
        starts: list[int] = []
        counts: list[int] = []
        index: list[np.ndarray[Any, Any]] = []
        for plan, row, count, first in self.entries:
            edit = plan.edits.get(name)
            if edit is None:
                continue
            base, positional = edit
            positions = np.arange(first, first + count)
            in_prompt = positions < plan.length
            if positional:
                local = np.where(in_prompt, positions, plan.length)
            else:
                local = np.where(in_prompt, 0, 1)
            starts.append(row)
            counts.append(count)
            index.append(base + local)
        if not starts:
            result: tuple[Any, Any] = (None, None)
        else:
            rows = self._rows(starts, counts)
            result = (rows, torch.from_numpy(np.concatenate(index)).to(device))
        self._edit[name] = result
        return result

    def _rows(self, starts: list[int], counts: list[int]) -> Any:
        if not starts:
            return slice(0, 0)
        contiguous = all(starts[i] + counts[i] == starts[i + 1] for i in range(len(starts) - 1))
        if contiguous:
            return slice(starts[0], starts[-1] + counts[-1])
        rows = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
        return torch.from_numpy(rows).to(self.device)
