"""``VLLMDriver``: tl's Driver protocol over a vLLM engine (capture, steering, generation)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Literal

import torch

from tl_core import ModelInfo, TLError, UserError
from tl_core.architecture import Architecture, FamilyDescription
from tl_core.certification import Certification
from tl_core.driver_api import (
    ForwardRequest,
    ForwardResult,
    HFTokenizer,
    ModelReadout,
    NamespaceFacts,
    RequestForward,
)
from tl_driver_vllm._dictionaries import check_replicated, pack_attachment
from tl_driver_vllm._driver_side._backend import classes_kept
from tl_driver_vllm._driver_side._certify import ANCHOR_LOGPROBS, certify_engine, refusal
from tl_driver_vllm._driver_side._derive import serving_layout
from tl_driver_vllm._driver_side._edit_tables import EditTables
from tl_driver_vllm._driver_side._gguf import gguf_checkpoint
from tl_driver_vllm._driver_side._inputs import check_room, refuse_positions
from tl_driver_vllm._driver_side._lifecycle import children, shutdown, socket_files
from tl_driver_vllm._driver_side._memory import available_memory, cpu_kv_cache
from tl_driver_vllm._driver_side._merge import merge_batched, pad_rows
from tl_driver_vllm._driver_side._namespace import INPUT_SITES, hook_namespace
from tl_driver_vllm._driver_side._options import (
    engine_kwargs,
    engine_mode,
    require_v1_runner,
    sampling_params,
    with_compiled_setup,
)
from tl_driver_vllm._driver_side._spawn import check_main_guard
from tl_driver_vllm._families import Layout, model_info
from tl_driver_vllm._run_message import RequestEntry, RunMessage
from tl_driver_vllm._wire import TAG_KEY, SharedFiles, unpack

if TYPE_CHECKING:
    from tl_core.driver_api import Attachment

__all__ = ["VLLMDriver"]

_FEATURES = frozenset({"generation", "batching", "position_interventions"})
# A child of vLLM's logger: the driver's boot decisions print with vLLM's own boot lines,
# under its format and level (VLLM_LOGGING_LEVEL), where a user looks for memory sizing.
_LOG = logging.getLogger("vllm.tl_driver_vllm")


class VLLMDriver(RequestForward, NamespaceFacts):
    """A vLLM engine serving tl's hooks; boot it with ``RemoteBridge.boot_vllm``.

    Captures and declarative interventions run inside the engine's workers, at every step
    of prefill and decoding, for batches of ragged prompts with per-prompt specs.

    Attributes:
        name: ``"vllm"``, the entry-point name users type.
        provides_sequence_logits: True: prompt-position logits are rebuilt from the final
            norm's output and the unembedding (vLLM itself computes them only at the end).
        tokenizer: The model's tokenizer (a ``tl_core.driver_api.HFTokenizer``).
        workers: What each worker's tl extension reported when it was installed (one dict
            per worker: its process id, tensor-parallel size and rank, ...).
    """

    name = "vllm"
    provides_sequence_logits = True

    def __init__(
        self,
        llm: Any,
        info: ModelInfo,
        tokenizer: HFTokenizer,
        *,
        layout: Layout,
        family: FamilyDescription,
        positions: bool,
        use_attn_result: bool = False,
        withheld: Mapping[str, str] | None = None,
    ) -> None:
        self._llm: Any | None = llm
        self.tokenizer = tokenizer
        self._layout = layout
        self._family = family
        self._positions = positions
        self._runs = itertools.count()
        self._readout: ModelReadout | None = None
        self._sockets: set[str] = set()
        self._processes: set[int] = set()
        self.workers: list[dict[str, Any]] = llm.collective_rpc(
            "tl_install",
            args=(
                info.architecture,
                info.n_layers,
                _sizes(info),
                dataclasses.asdict(layout),
                family.as_dict(),
            ),
        )
        self._raw = all(w["pid"] == os.getpid() for w in self.workers)
        # Workers in other processes hand results over through shared memory.
        self._shared = SharedFiles(enabled=not self._raw)
        self._tp = max(int(w["tp_size"]) for w in self.workers)
        self._withheld = dict(withheld or {})
        self._attn_result = use_attn_result
        self._certification: Certification | None = None
        self._resident = all(w.get("resident", False) for w in self.workers)
        self._namespace = hook_namespace(
            info,
            self._layout,
            self._family,
            attn_result=use_attn_result,
            tp_size=self._tp,
            withheld=self._withheld,
            compiled=self.compiled,
            resident=self._resident,
        )
        self._ranks_checked = self._tp == 1

    @classmethod
    def boot(
        cls,
        model: str | os.PathLike[str],
        *,
        tokenizer: str | None = None,
        dtype: Any = None,
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_batching: bool = True,
        enable_position_interventions: bool = True,
        use_attn_result: bool = False,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        gguf_file: str | None = None,
        certify: bool = True,
        **vllm_kwargs: Any,
    ) -> VLLMDriver:
        """Start a vLLM engine for ``model`` with tl's worker extension.

        Prefix caching is always off (cached positions would have no activations). On
        vLLM's CPU build the engine is compiled (vLLM's default): runs with nothing to
        capture or edit, residual-stream captures and edits, and logits use the
        compiled graph, every other run the model's eager forward, chosen per run (see the
        README's "Compilation"); ``enforce_eager=True`` runs everything eagerly. On other
        platforms the engine runs eagerly (one log line says so) and
        ``enforce_eager=False`` is refused.

        On vLLM's CPU build with no memory option (``kv_cache_memory_bytes``,
        ``gpu_memory_utilization``, ``VLLM_CPU_KVCACHE_SPACE``), the KV cache is sized for
        ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped at a quarter of the
        memory available now, and one log line says what was chosen; explicit options win
        and GPU builds keep vLLM's default. A script that boots at its top level, outside
        ``if __name__ == "__main__":``, gets the engine in this process when one process
        suffices (a spawned engine process would re-run the script), else a
        ``ConfigError`` naming the line.

        Args:
            model: A local checkpoint folder or a hub id vLLM can load, or a GGUF file
                (``"model.gguf"``, or a folder plus ``gguf_file=``; needs
                ``tl-driver-vllm[gguf]``), which is dequantised once into a cached
                safetensors folder (``tl_core.gguf.gguf_cache_dir``; vLLM 0.32 has no
                GGUF loader) in ``dtype`` (float32 when ``None``).
            tokenizer: Tokenizer folder or id, when not the model's.
            dtype: ``"float32"``, ``"bfloat16"``, a torch dtype, or ``None`` (checkpoint's).
            gpu_memory_utilization: Passed to vLLM (GPU only).
            max_model_len: Longest prompt plus generation.
            max_num_batched_tokens: Tokens per engine step (longer prompts are chunked).
            enable_batching: ``False`` runs one request at a time (``max_num_seqs=1``).
            enable_position_interventions: ``False`` refuses specs with ``pos``.
            use_attn_result: Also serve ``attn.hook_result`` (per-head outputs), as on
                the hf driver.
            tensor_parallel_size: vLLM tensor parallelism.
            pipeline_parallel_size: vLLM pipeline parallelism.
            gguf_file: The GGUF file's name inside the ``model`` folder.
            certify: Prove every served hook on the booted engine before serving it (one
                8-token forward and tl-core's equations, about 3% of a boot; see
                ``certification``). ``False`` skips it for a family with a hand-checked row
                (its parity tests vouch for it); an architecture placed by the hf driver's
                description is always certified.
            **vllm_kwargs: Any other ``vllm.LLM`` argument (``kv_cache_memory_bytes``, ...).

        Returns:
            The driver (wrap it in ``RemoteBridge``; ``RemoteBridge.boot_vllm`` does).

        Raises:
            ConfigError: Unsupported architecture or option, a default KV cache that cannot
                fit, or a boot that spawned processes would re-run, before the engine starts.
        """
        from transformers import AutoConfig, AutoTokenizer

        path = gguf_checkpoint(model, gguf_file, dtype)
        trust = bool(vllm_kwargs.get("trust_remote_code", False))
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
        # Unsupported architectures and configs fail here, before any engine work.
        serving = serving_layout(config, vllm_kwargs.get("model_impl"))
        layout, family = serving.layout, serving.family
        if serving.model_impl is not None:
            vllm_kwargs["model_impl"] = serving.model_impl
        info = model_info(config, family)
        kwargs = engine_kwargs(
            path,
            tokenizer=tokenizer,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_batching=enable_batching,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            vllm_kwargs=dict(vllm_kwargs),
        )
        kwargs, eager_note = engine_mode(kwargs)
        _use_v1_runner()
        kwargs = with_compiled_setup(kwargs, layout, info.d_model)
        kwargs, notes = _machine_defaults(info, config, kwargs, frame=sys._getframe())
        if eager_note is not None:
            notes.append((logging.INFO, eager_note))
        hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer or path, trust_remote_code=trust)
        from vllm import LLM

        sockets_before, children_before = socket_files(), children()
        kept = classes_kept(config) if layout.backend == "transformers" else nullcontext()
        try:
            with kept:
                llm = LLM(**kwargs)
        finally:
            # vLLM sets its logging up inside LLM(): logged earlier, these lines would have
            # no handler. They also explain a boot that fails.
            for level, note in notes:
                _LOG.log(level, note)
        sockets = socket_files() - sockets_before
        started = children() - children_before
        try:
            # vLLM counts the token it samples against max_model_len, so the positions the
            # model runs (tl's n_ctx, tl_core.driver_api.fits_context) are one fewer.
            limit = int(llm.llm_engine.model_config.max_model_len)
            info = model_info(config, family, max_model_len=limit - 1)
            driver = cls(
                llm, info, HFTokenizer(hf_tokenizer), layout=layout, family=family,
                positions=enable_position_interventions,
                use_attn_result=use_attn_result, withheld=serving.withheld,
            )  # fmt: skip
            driver._sockets, driver._processes = sockets, started
            driver._config, driver._model_name = config, str(model)
            driver._facts, driver._derived = serving.facts, serving.derived
            if certify or serving.derived:
                driver._certify_at_boot()
        except BaseException:
            shutdown(llm, sockets, started)
            raise
        return driver

    # -- certification ----------------------------------------------------------------

    @property
    def certification(self) -> Certification | None:
        """The boot's certification report (``None`` for a row booted with ``certify=False``)."""
        return self._certification

    def certify(self) -> Certification:
        """Check every served hook now with tl-core's equations over one engine forward.

        Serves nothing new and hides nothing; the boot of a layout read from a description
        already withheld what failed.
        """
        assert self._config is not None, "certify() needs the checkpoint's config, kept at boot"
        self._certifying = True
        try:
            return certify_engine(
                self,
                self._config,
                model=self._model_name,
                description=dict(self._facts),
                derived=self._derived,
            )
        finally:
            self._certifying = False

    @property
    def architecture(self) -> Architecture | None:
        """The served checkpoint's engine-independent description (block form, norms,
        attention and MLP variants, unembedding): ``tl_core.architecture.Architecture``, its
        family's description read against its config, as on the hf driver (``None`` before
        a boot)."""
        if self._config is None:
            return None
        return self._family.architecture(self._config, self.info)

    _config: Any = None
    _certifying = False
    _model_name: str = "<model>"
    _facts: Mapping[str, str] = {}
    _derived: bool = False

    def _certify_at_boot(self) -> None:
        """Certify; refuse a run that fails, withhold hooks that fail."""
        cert = self.certify()
        refused = refusal(cert, self.info.architecture)
        if refused is not None:
            raise refused
        failed = {
            n: f"uncertified: {c.reason}"
            for n, c in cert.statuses.items()
            if c.status == "uncertified" and n in self._namespace.served
        }
        if failed:
            self._withheld.update(failed)
            self._namespace = hook_namespace(
                self.info,
                self._layout,
                self._family,
                attn_result=self._attn_result,
                tp_size=self._tp,
                withheld=self._withheld,
                compiled=self.compiled,
                resident=self._resident,
            )
            if not self._derived:
                _LOG.warning(
                    "%d hooks of %s failed certification and are not served (first: %s); see "
                    "bridge.certification", len(failed), self._model_name, next(iter(failed)),
                )  # fmt: skip
        self._certification = cert
        if self._derived:
            _LOG.warning(
                "%s: %s has no vLLM row; %s; %d hooks certified on the engine and served at level "
                "%r (tl certify %s --driver vllm shows the report)",
                self._model_name, self.info.architecture, self._facts.get("layout", ""),
                len(self._namespace.served), cert.level, self._model_name,
            )  # fmt: skip

    # -- facts ------------------------------------------------------------------------

    @property
    def compiled(self) -> bool:
        """Whether vLLM runs the model compiled (``enforce_eager=False``): then
        ``namespace.eager_only`` lists the hooks whose runs take the eager forward."""
        return all(w["compiled"] for w in self.workers)

    @property
    def info(self) -> ModelInfo:
        """The model's sizes and structure."""
        return self.namespace.info

    def supports(self, feature: str) -> bool:
        """Whether the driver has ``feature`` (generation, batching, position_interventions)."""
        if feature == "position_interventions":
            return self._positions
        return feature in _FEATURES

    def readout(self) -> ModelReadout:
        """The final norm and unembedding weights (fetched from the workers once)."""
        if self._readout is None:
            parts = [r for r in self._engine().collective_rpc("tl_readout") if r]
            first = parts[0]
            w_u = torch.cat([unpack(p["W_U"]) for p in parts], dim=1)[:, : self.info.d_vocab]
            b_u = None
            if first["b_U"] is not None:
                b_u = torch.cat([unpack(p["b_U"]) for p in parts])[: self.info.d_vocab]
            self._readout = ModelReadout(
                W_U=w_u,
                b_U=b_u,
                ln_final_weight=unpack(first["ln_weight"]),
                ln_final_bias=None if first["ln_bias"] is None else unpack(first["ln_bias"]),
                # A vLLM row's description always names its norm kind (its final norm is
                # read with it), so the kind is established here.
                normalization_type="LN" if self._family.norm == "layernorm" else "RMS",
                eps=float(first["eps"]),
                logit_softcap=first["softcap"],
            )
        return self._readout

    # -- dictionaries -----------------------------------------------------------------

    def attach_dictionary(self, attachment: Attachment) -> None:
        """Send a dictionary to every worker, once; it then runs inside every forward
        (batched across requests) and its sites are served until ``detach_dictionary``.
        Researchers call ``bridge.add_sae(...)``.

        Raises:
            HookNameError: The namespace refuses the site (see ``HookNamespace.with_dictionary``).
            UnsupportedFeatureError: A head- or neuron-level site under tensor parallelism.
        """
        namespace = self.namespace.with_dictionary(attachment.site)
        check_replicated(self.namespace, attachment.site, self._tp)
        self._engine().collective_rpc(
            "tl_attach_dictionary", args=(pack_attachment(attachment, raw=self._raw),)
        )
        self._namespace = namespace

    def detach_dictionary(self, hook: str) -> None:
        """Take the dictionary at canonical ``hook`` out of every worker (and its sites)."""
        if hook not in self.namespace.dictionaries:
            return
        if self._llm is not None:  # a closed engine runs nothing: only its sites go
            self._llm.collective_rpc("tl_detach_dictionary", args=(hook,))
        self._namespace = self.namespace.without_dictionary(hook)

    # -- running ----------------------------------------------------------------------

    def run(self, request: ForwardRequest) -> ForwardResult:
        """Run one validated request in the engine (``forward`` is its keyword form).

        Captures cover the prompt positions; specs stay active at every decoding step
        (specs with ``pos`` edit prompt positions only). ``request.logits``: ``"all"``
        gives ``[batch, pos, vocab]``, ``"last"`` ``[batch, 1, vocab]`` computed only at
        each prompt's last position, ``"none"`` computes and sends none; logits come in the
        engine's dtype. ``new_tokens`` (padded with EOS after a prompt stops) comes when
        ``max_new_tokens >= 1``.

        Raises:
            UserError: A prompt plus its new tokens past ``max_model_len``, or a spec with
                ``pos`` on an engine booted without position interventions; before any
                engine work.
        """
        llm = self._engine()
        check_room(request.lengths, request.max_new_tokens, n_ctx=self.info.n_ctx)
        if not self._positions:
            refuse_positions(request.plan.per_prompt)
        rows = request.batch.rows()
        lengths = request.lengths
        names = list(request.capture)
        plan = request.plan
        max_new_tokens = request.max_new_tokens
        return_logits: bool | Literal["last"] = (
            "last" if request.logits == "last" else request.logits == "all"
        )
        sampling = sampling_params(request.sampling)
        stop_at_eos = request.stop_at_eos
        from vllm import SamplingParams

        run = next(self._runs)
        tags = [f"r{run}-{b}" for b in range(len(rows))]
        inputs = [n for n in names if n in INPUT_SITES]
        engine_names = [n for n in names if n not in INPUT_SITES]
        tables = EditTables(self._features)
        entries = tuple(
            RequestEntry(
                tag,
                index,
                length,
                tuple(engine_names),
                return_logits,
                edits={
                    hook: tables.rows(hook, specs, length)
                    for hook, specs in specs_by_hook.items()
                    if specs
                },
            )
            for index, (tag, specs_by_hook, length) in enumerate(
                zip(tags, plan.per_prompt, lengths, strict=True)
            )
        )
        check = not self._ranks_checked
        message = RunMessage(
            entries, tables.stacked(), width=max(lengths), raw=self._raw, all_ranks=check,
            shared=self._shared.offer(),
        )  # fmt: skip
        # Certification compares vLLM's own log-probabilities with tl's readout.
        anchor = {"logprobs": ANCHOR_LOGPROBS} if self._certifying else {}
        params = [
            SamplingParams(
                max_tokens=max(1, max_new_tokens),
                ignore_eos=not stop_at_eos,
                detokenize=False,
                extra_args={TAG_KEY: tag},
                **sampling,
                **anchor,
            )
            for tag in tags
        ]
        prompts = [{"prompt_token_ids": row} for row in rows]
        llm.collective_rpc("tl_begin", args=(message.to_wire(),))
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results = self._shared.receive(llm.collective_rpc("tl_collect"))
        except BaseException:
            llm.collective_rpc("tl_abort")
            raise
        batched = merge_batched(results, vocab=self.info.d_vocab, check_ranks=check)
        self._ranks_checked = True
        missing = [
            n for n in engine_names + (["logits"] if return_logits else []) if n not in batched
        ]
        if missing and (self._certifying and "logits" not in missing):
            pass  # certification reports each hook that never fired
        elif missing:
            raise TLError(f"the engine returned no values for {missing}; see the worker logs")
        captured = {n: batched[n] for n in engine_names if n in batched}
        captured.update(_input_sites(inputs, rows, lengths))
        logits = batched["logits"] if return_logits else None
        new_tokens = None
        if max_new_tokens >= 1:
            new_tokens = self._new_tokens(outputs, max_new_tokens)
        return ForwardResult(logits, captured, new_tokens, outputs, lengths)

    def _features(self, hook: str) -> tuple[int, ...]:
        shape = self.namespace.feature_shape(hook)
        assert shape is not None, f"{hook!r} takes no specs"  # build_plan refuses patterns
        return shape

    def _new_tokens(self, outputs: Sequence[Any], max_new_tokens: int) -> torch.Tensor:
        generated = [list(o.outputs[0].token_ids)[:max_new_tokens] for o in outputs]
        width = max(len(g) for g in generated)
        fill = self.tokenizer.eos_token_id
        fill = fill if fill is not None else (self.tokenizer.pad_token_id or 0)
        return torch.tensor([g + [fill] * (width - len(g)) for g in generated], dtype=torch.long)

    def _engine(self) -> Any:
        if self._llm is None:
            raise UserError("this vllm driver is closed; boot a new one")
        return self._llm

    def close(self) -> None:
        """Shut the engine down (worker processes, sockets); safe to call twice."""
        llm, self._llm = self._llm, None
        if llm is not None:
            try:
                shutdown(llm, self._sockets, self._processes)
            finally:
                self._shared.close()


def _sizes(info: ModelInfo) -> dict[str, Any]:
    """The global sizes workers need to place their tensor-parallel shards."""
    return {
        "n_heads": info.n_heads,
        "n_kv_heads": info.kv_heads,
        "d_model": info.d_model,
        "d_mlp": info.d_mlp,
        "experts_per_token": info.experts_per_token,
        "parallel_attn_mlp": info.parallel_attn_mlp,
    }


def _machine_defaults(
    info: ModelInfo, config: Any, kwargs: dict[str, Any], *, frame: Any
) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """The CPU build's KV-cache default and the ``__main__``-guard check, before boot.

    Returns:
        The ``vllm.LLM`` arguments and the lines to log (level, message).
    """
    from vllm.platforms import current_platform

    is_cpu = bool(current_platform.is_cpu())
    notes: list[tuple[int, str]] = []
    if is_cpu:
        choice = cpu_kv_cache(
            info, kwargs, config_dtype=_config_dtype(config), available=available_memory()
        )
        if choice is not None:
            kwargs = choice.kwargs
            notes.append((logging.INFO, choice.message))
    workers = int(kwargs["tensor_parallel_size"]) * int(kwargs["pipeline_parallel_size"])
    moved = check_main_guard(is_cpu=is_cpu, workers=workers, frame=frame)
    if moved is not None:
        notes.append((logging.WARNING, moved))
    return kwargs, notes


def _config_dtype(config: Any) -> Any:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "dtype", None) or getattr(text, "torch_dtype", None)


def _input_sites(
    names: Sequence[str], rows: Sequence[Sequence[int]], lengths: Sequence[int]
) -> dict[str, torch.Tensor]:
    """Token ids and position ids of each prompt, as the engine received them."""
    per_site = {
        "embed.hook_in": [torch.tensor(row, dtype=torch.long) for row in rows],
        "pos_embed.hook_in": [torch.arange(n, dtype=torch.long) for n in lengths],
    }
    return {name: pad_rows(per_site[name], lengths) for name in names}


def _use_v1_runner() -> None:
    """Have vLLM boot its V1 model runner (``require_v1_runner``), even where an engine
    booted earlier in this process froze vLLM's reading of the environment."""
    require_v1_runner()
    import vllm.envs as vllm_envs

    if vllm_envs.VLLM_USE_V2_MODEL_RUNNER is not False:
        # vLLM caches its environment once an engine has started (``enable_envs_cache``);
        # the next engine re-enables the cache after reading the switch.
        vllm_envs.disable_envs_cache()
