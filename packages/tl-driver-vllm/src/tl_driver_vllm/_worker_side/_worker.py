"""The worker extension vLLM mixes into every worker (``worker_extension_cls``).

The driver reaches it only through ``LLM.collective_rpc``: ``tl_install`` once after boot,
then ``tl_begin`` / ``tl_collect`` around each run (``tl_abort`` on errors). Every method
name starts with ``tl_`` and every attribute with ``_tl_`` so nothing collides with the
worker's own. This module is imported in every worker process and is safe to import twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, cast

import torch
from torch.utils.hooks import RemovableHandle

from tl_core import TLError
from tl_core.architecture import FamilyDescription
from tl_driver_vllm._dictionaries import release_retired_handles, unpack_attachment
from tl_driver_vllm._families import Layout
from tl_driver_vllm._run_message import RunMessage
from tl_driver_vllm._wire import TAG_KEY, Outbox, pack
from tl_driver_vllm._worker_side._block_hooks import install_activations
from tl_driver_vllm._worker_side._compiled import EagerSwitch
from tl_driver_vllm._worker_side._patterns import AttentionFacts, attention_facts, rebuild
from tl_driver_vllm._worker_side._resident import ResidentSites, install_on_load
from tl_driver_vllm._worker_side._run_state import NORMED, RequestPlan, RunState, Step
from tl_driver_vllm._worker_side._shards import Shard, layer_shards
from tl_driver_vllm._worker_side._sites import (
    attention_inputs,
    install_sites,
    norm_eps,
    pattern_needs,
    sub,
)

__all__ = ["TLWorkerExtension"]

_log = logging.getLogger("tl_driver_vllm")

# Residual-stream sites must be on the model before vLLM's compiled warm-up traces it.
with contextlib.suppress(ImportError):
    install_on_load()


def _ranks() -> tuple[int, int, int, int]:
    from vllm.distributed import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size


class TLWorkerExtension:
    """RPC surface of the vllm driver inside each vLLM worker."""

    _tl_layout: Layout
    _tl_family: FamilyDescription
    _tl_n_layers: int
    _tl_state: RunState | None
    _tl_handles: list[RemovableHandle]
    _tl_attention: dict[int, AttentionFacts]
    _tl_shards: dict[str, Shard]
    _tl_top_k: int | None
    _tl_outbox: Outbox | None
    _tl_dictionaries: dict[str, Any]
    _tl_switch: EagerSwitch
    _tl_resident: ResidentSites | None
    _tl_resident_run: bool

    def tl_install(
        self,
        architecture: str,
        n_layers: int,
        sizes: dict[str, Any],
        layout: dict[str, Any],
        family: dict[str, Any],
    ) -> dict[str, Any]:
        """Remember the family layout and this rank's share of every layer's heads and
        neurons; report this worker's process and parallel ranks.

        ``sizes`` holds the model's global ``n_heads``, ``n_kv_heads``, ``d_model`` and
        ``experts_per_token`` and whether its blocks are parallel (from the driver's
        ``ModelInfo``); ``layout`` the fields of the driver's ``Layout`` (a row, or one read
        from the hf driver's adapter) and ``family`` its family's description settled for
        this checkpoint (``FamilyDescription.as_dict``). Where vLLM's model computes another MLP activation than the
        checkpoint (``Layout.activation``), the checkpoint's is installed here, once.
        """
        self._tl_layout = Layout(**layout)
        self._tl_family = FamilyDescription.from_dict(family)
        self._tl_n_layers = n_layers
        self._tl_state = None
        self._tl_outbox = None
        self._tl_handles = []
        self._tl_dictionaries = {}
        tp_rank, tp_size, pp_rank, pp_size = _ranks()
        model = self._tl_model()
        self._tl_switch = EagerSwitch(model)
        self._tl_resident = getattr(model, "_tl_resident", None) if self._tl_switch else None
        self._tl_resident_run = False
        self._tl_fix_activations(architecture, tp_rank)
        self._tl_top_k = sizes.get("experts_per_token")
        self._tl_attention, self._tl_shards = self._tl_layer_facts(sizes, tp_rank, tp_size)
        return {
            "pid": os.getpid(),
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "pp_rank": pp_rank,
            "pp_size": pp_size,
            "model_class": type(model).__name__,
            "dtype": str(next(model.parameters()).dtype),
            "compiled": bool(self._tl_switch),
            "resident": self._tl_resident is not None,
        }

    def tl_begin(self, config: dict[str, Any]) -> None:
        """Set up one run from the driver's ``RunMessage`` (as ``to_wire`` sends it): take
        its edit tables and hook the sites it needs.

        The run's result buffers are made by its ``Outbox``: in the driver's shared-memory
        folder when this worker is another process on the driver's machine.
        """
        self.tl_abort()
        message = RunMessage.from_wire(config)
        model = self._tl_model()
        param = next(model.parameters())
        columns = {name: shard.columns for name, shard in self._tl_shards.items()}
        needs = pattern_needs(self._tl_layout, self._tl_n_layers)
        outbox = Outbox(raw=message.raw, offer=message.shared)
        self._tl_outbox = outbox
        state = RunState(
            message, param.device, param.dtype, columns=columns, needs=needs, allocate=outbox.empty,
            dictionaries=self._tl_dictionaries,
        )  # fmt: skip
        self._tl_state = state
        resident = self._tl_resident
        if resident is not None and state.needed():
            why = resident.start(state)
            if why is None:
                # Served inside the compiled graph: only the step layout is set in Python.
                self._tl_resident_run = True
                self._tl_handles = [
                    model.register_forward_pre_hook(self._tl_step, with_kwargs=True)
                ]
                return
            _log.debug("tl: this run runs the eager forward: %s", why)
        _, tp_size, _, _ = _ranks()
        handles = install_sites(
            model, self._tl_layout, self._tl_family, self._tl_n_layers, state,
            attention=self._tl_attention, tp_size=tp_size, top_k=self._tl_top_k,
        )  # fmt: skip
        if handles:
            handles.append(model.register_forward_pre_hook(self._tl_step, with_kwargs=True))
            if self._tl_switch:
                # The compiled graph was traced without these hooks: run the eager engine.
                self._tl_switch.set(True)
        self._tl_handles = handles

    def tl_attach_dictionary(self, payload: dict[str, Any]) -> None:
        """Keep a dictionary (``_dictionaries.pack_attachment``) on this worker's device; it
        runs in every later run until ``tl_detach_dictionary``."""
        device = next(self._tl_model().parameters()).device
        attachment = unpack_attachment(payload, device)
        self._tl_dictionaries[attachment.site.hook] = attachment

    def tl_detach_dictionary(self, hook: str) -> None:
        """Drop the dictionary at canonical ``hook``."""
        self._tl_dictionaries.pop(hook, None)
        release_retired_handles()

    def tl_collect(self) -> dict[str, Any]:
        """End the run: unhook, and return every result as one ``[batch, width, ...]``
        tensor per hook (logits included), carried as the ``Outbox`` decides."""
        state, outbox = self._tl_state, self._tl_outbox
        self._tl_unhook()
        self._tl_state = self._tl_outbox = None
        tp_rank, tp_size, pp_rank, _ = _ranks()
        result: dict[str, Any] = {
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "pp_rank": pp_rank,
            "batched": {},
        }
        if state is None or outbox is None:
            return result
        keep_replicated = tp_rank == 0 or state.all_ranks
        shards = self._tl_shards
        returned = {name for plan in state.plans.values() for name in plan.returned}
        try:
            with torch.no_grad():
                state.check_written()
                self._tl_patterns(state)
                values = {
                    name: state.batched(name)
                    for name in state.buffers
                    if name in returned and (keep_replicated or name in shards)
                }
                # Every rank sends its vocabulary shard of the logits.
                values.update(self._tl_logits(state))
                # Prompts in the driver's order.
                result["batched"] = {name: outbox.send(value) for name, value in values.items()}
        except BaseException:
            outbox.discard()
            raise
        outbox.finish()
        # Where this rank's piece of each head- or neuron-level hook sits in the full tensor.
        result["shards"] = {name: [s.axis, s.start, s.count] for name, s in shards.items()}
        return result

    def tl_abort(self) -> None:
        """Remove this run's hooks, files and state (safe to call at any time)."""
        self._tl_unhook()
        outbox = getattr(self, "_tl_outbox", None)
        if outbox is not None:
            outbox.discard()
        self._tl_outbox = None
        self._tl_state = None

    def _tl_unhook(self) -> None:
        for handle in getattr(self, "_tl_handles", []):
            handle.remove()
        self._tl_handles = []
        resident = getattr(self, "_tl_resident", None)
        if resident is not None:
            resident.end()
        self._tl_resident_run = False
        switch = getattr(self, "_tl_switch", None)
        if switch is not None and switch.eager:
            switch.set(False)

    def tl_readout(self) -> dict[str, Any]:
        """Final norm and unembedding weights (this rank's vocabulary shard), as plain data."""
        model = self._tl_model()
        norm = sub(sub(model, self._tl_layout.inner), self._tl_layout.final_norm)
        if norm is None:
            return {}
        head = self._tl_head()
        raw = getattr(norm, "weight", None)
        if raw is None:  # a norm without parameters (OLMo's)
            weight = torch.ones(head.weight.shape[1], device=head.weight.device)
        else:
            weight = cast(torch.Tensor, raw).detach().float()
        if self._tl_family.norm == "rms_plus_one":
            weight = weight + 1.0
        bias = getattr(norm, "bias", None)
        head_bias = getattr(head, "bias", None)
        processor = getattr(model, "logits_processor", None)
        return {
            "W_U": pack(head.weight.detach().float().T),
            "b_U": None if head_bias is None else pack(head_bias.detach().float()),
            "ln_weight": pack(weight),
            "ln_bias": None if bias is None else pack(bias.detach().float()),
            "eps": norm_eps(norm, self._tl_family.norm_kind),
            "softcap": getattr(processor, "soft_cap", None),
        }

    def _tl_fix_activations(self, architecture: str, tp_rank: int) -> None:
        layout = self._tl_layout
        layers = getattr(sub(self._tl_model(), layout.inner), layout.layers)
        changed = getattr(self._tl_model(), "_tl_activations", None)
        if changed is None:  # not installed when vLLM loaded the model (an eager engine)
            changed = install_activations(layers, layout.mlp, layout.activation, self._tl_n_layers)
        if changed and tp_rank == 0 and layout.activation is not None:
            path, name = layout.activation
            _log.warning(
                "tl: vLLM's %s computes another MLP activation than the checkpoint defines; "
                "%d MLPs now use %r at %r, as transformers and the hf driver do",
                architecture, changed, name, path,
            )  # fmt: skip

    def _tl_layer_facts(
        self, sizes: dict[str, Any], tp_rank: int, tp_size: int
    ) -> tuple[dict[int, AttentionFacts], dict[str, Shard]]:
        """Per layer held here: its attention settings and this rank's shards."""
        layout = self._tl_layout
        inner = sub(self._tl_model(), layout.inner)
        layers = getattr(inner, layout.layers)
        facts: dict[int, AttentionFacts] = {}
        shards: dict[str, Shard] = {}
        for i in range(self._tl_n_layers):
            layer = sub(layers[i], "")
            attention = sub(sub(layer, layout.attn), layout.attention)
            if layer is None or attention is None:
                continue
            facts[i] = attention_facts(attention)
            mlp = sub(layer, layout.mlp)
            down = sub(mlp, layout.down) if layout.down else None
            neurons = getattr(down, "input_size_per_partition", None)
            shards.update(
                layer_shards(
                    i, tp_rank=tp_rank, tp_size=tp_size, heads=facts[i].heads,
                    kv_heads=facts[i].kv_heads,
                    total_kv_heads=int(sizes.get("n_kv_heads") or facts[i].kv_heads * tp_size),
                    head_dim=facts[i].head_dim, d_model=int(sizes.get("d_model", 0)),
                    neurons=None if neurons is None else int(neurons),
                )
            )  # fmt: skip
        return facts, shards

    def _tl_patterns(self, state: RunState) -> None:
        """Rebuild the scores and patterns the run asked for, layer by layer, batched."""
        wanted = {name for plan in state.plans.values() for name in plan.returned}
        lengths = torch.zeros(state.batch, dtype=torch.long)
        for plan in state.plans.values():
            lengths[plan.index] = plan.length
        for i, facts in self._tl_attention.items():
            p = f"blocks.{i}.attn."
            names = [n for n in (p + "hook_attn_scores", p + "hook_pattern") if n in wanted]
            if not names:
                continue
            q_name, k_name = attention_inputs(self._tl_layout, i)
            scores, pattern = rebuild(state.batched(q_name), state.batched(k_name), lengths, facts)
            values = {p + "hook_attn_scores": scores, p + "hook_pattern": pattern}
            for name in names:
                state.set_batched(name, values[name])

    # -- inside the forward pass ------------------------------------------------------

    def _tl_model(self) -> torch.nn.Module:
        # get_model() unwraps vLLM's CUDA-graph wrappers where the GPU runner adds them.
        return self.model_runner.get_model()  # type: ignore[attr-defined,no-any-return]

    def _tl_head(self) -> Any:
        model = self._tl_model()
        if self._tl_layout.lm_head == "lm_head":
            return model.lm_head
        return sub(sub(model, self._tl_layout.inner), self._tl_layout.embed)

    def _tl_step(self, module: Any, args: Any, kwargs: Any) -> None:
        """Top-level pre-hook: map this step's rows to (request, position)."""
        state = self._tl_state
        if state is None:
            return
        runner = self.model_runner  # type: ignore[attr-defined]
        n = runner.input_batch.num_reqs
        starts = runner.query_start_loc.np[: n + 1]
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        rows = positions.shape[-1] if isinstance(positions, torch.Tensor) else 0
        if n == 0 or rows < int(starts[n]):
            # Not a scheduled step (vLLM's dummy and profiling runs): nothing to map.
            state.step = Step([], torch.device("cpu"))
        else:
            state.step = self._tl_map_rows(state, runner, n, starts, positions.device)
        if self._tl_resident_run:
            self._tl_resident.step(state)  # type: ignore[union-attr]

    def _tl_map_rows(
        self, state: RunState, runner: Any, n: int, starts: Any, device: torch.device
    ) -> Step:
        """Rows of this step's tracked requests: ``(plan, first row, count, position)``."""
        batch = runner.input_batch
        computed = batch.num_computed_tokens_cpu[:n]
        entries = []
        for i, req_id in enumerate(batch.req_ids[:n]):
            if req_id not in state.tag_of:
                request = runner.requests.get(req_id)
                extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
                state.tag_of[req_id] = extra.get(TAG_KEY)
            tag = state.tag_of[req_id]
            plan = state.plans.get(tag) if tag is not None else None
            if plan is not None:
                count = int(starts[i + 1] - starts[i])
                entries.append((plan, int(starts[i]), count, int(computed[i])))
        return Step(entries, device)

    def _tl_logits(self, state: RunState) -> dict[str, torch.Tensor]:
        """``unembed.hook_out`` and logits on this rank's vocabulary shard, batched, in the
        engine's dtype, from the captured final-norm output.

        Only the rows asked for go through the unembedding: each prompt's positions for
        ``unembed.hook_out`` and sequence logits (``[batch, width, vocab]``), each prompt's
        last position for ``"last"`` (``[batch, 1, vocab]``).
        """
        normed = state.buffers.get(NORMED)
        plans = list(state.plans.values())
        if normed is None or not plans:
            return {}
        modes = {plan.logits for plan in plans if plan.logits}
        if len(modes) > 1:
            raise TLError(f"one run asked for logits in several forms {sorted(map(str, modes))}")
        head = self._tl_head()
        weight = head.weight.t()
        bias = getattr(head, "bias", None)
        width, vocab = normed.shape[1], weight.shape[1]

        def unembed(dst: torch.Tensor, src: torch.Tensor) -> None:
            if bias is None:
                torch.mm(src, weight, out=dst)
            else:
                torch.addmm(bias, src, weight, out=dst)

        def sequence(taken: list[RequestPlan]) -> torch.Tensor:
            out = state.allocate((state.batch, width, vocab), normed.dtype, normed.device)
            if all(p.length == width for p in taken) and len(taken) == state.batch:
                unembed(out.view(-1, vocab), normed.view(-1, normed.shape[-1]))
                return out
            out.zero_()
            for plan in taken:
                unembed(out[plan.index, : plan.length], normed[plan.index, : plan.length])
            return out

        out: dict[str, torch.Tensor] = {}
        if any("unembed.hook_out" in plan.capture for plan in plans):
            out["unembed.hook_out"] = sequence(
                [p for p in plans if "unembed.hook_out" in p.capture]
            )
        if not modes:
            return out
        taken = [p for p in plans if p.logits]
        if modes == {"last"}:
            logits = state.allocate((state.batch, 1, vocab), normed.dtype, normed.device)
            if len(taken) == state.batch:
                ends = [p.length - 1 for p in sorted(taken, key=lambda p: p.index)]
                rows = torch.arange(state.batch, device=normed.device)
                last = normed[rows, torch.tensor(ends, device=normed.device)]
                unembed(logits.view(state.batch, vocab), last)
            else:
                logits.zero_()
                for plan in taken:
                    unembed(logits[plan.index], normed[plan.index, plan.length - 1 : plan.length])
        elif "unembed.hook_out" in out and len(taken) == len(plans):
            logits = state.allocate(out["unembed.hook_out"].shape, normed.dtype, normed.device)
            logits.copy_(out["unembed.hook_out"])
        else:
            logits = sequence(taken)
        processor = getattr(self._tl_model(), "logits_processor", None)
        cap = getattr(processor, "soft_cap", None)
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)  # zero padding stays zero
        scale = getattr(processor, "scale", 1.0)
        if scale != 1.0:
            logits.mul_(scale)
        out["logits"] = logits
        return out
