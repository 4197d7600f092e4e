"""``HFDriver``: the ``LocalDriver`` over a HuggingFace transformers causal or masked LM."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from tl_core import HookPoint, ModelInfo, UnsupportedFeatureError, UserError
from tl_core.architecture import Architecture
from tl_core.certification import Certification
from tl_core.driver_api import (
    ForwardRequest,
    ForwardResult,
    HFTokenizer,
    LocalDriver,
    ModelReadout,
    Tokenizer,
    canonical_hook_names,
)
from tl_driver_hf._architecture._infer import InferredArchitecture, infer_architecture
from tl_driver_hf._architecture._kinds import lm_kind
from tl_driver_hf._architecture._modules import resolve_modules
from tl_driver_hf._architecture._vision import model_pixels, read_vision
from tl_driver_hf._certification._boot_certification import BootDecision, BootFacts, certify_at_boot
from tl_driver_hf._certification._certify import certify_driver
from tl_driver_hf._certification._image_checks import IMAGE_EQUATIONS
from tl_driver_hf._options import BootOptions
from tl_driver_hf._runtime._arena import CaptureArena, head_into_arena
from tl_driver_hf._runtime._attention import ATTN_IMPLEMENTATION, attention_sites
from tl_driver_hf._runtime._inline_attention import inline_attention
from tl_driver_hf._runtime._model import HFHookedModel
from tl_driver_hf._runtime._stopping import Stop, configs_of, prober, stop_after, stopper
from tl_driver_hf._runtime._torch_hooks import (
    ROUTER_LOGITS_READ_ONLY,
    ForwardBookkeeping,
    _with_input,
)
from tl_driver_hf._runtime._wiring import Wiring
from tl_driver_hf._seq2seq._boot import boot_seq2seq, is_encoder_decoder
from tl_driver_hf._signal._boot import SIGNAL_KINDS, boot_signal, signal_reads
from tl_driver_hf._weights._compat import CompatState, enable_compatibility
from tl_driver_hf._weights._image_processor import load_image_processor, processed_pixels
from tl_driver_hf._weights._loading import (
    adapter_or_none,
    apply_n_ctx,
    built_class,
    gguf_folder,
    load_config,
    load_model,
    load_tokenizer,
)
from tl_driver_hf.adapters import ArchitectureAdapter

__all__ = ["HFDriver"]

_IMPL_ATTR = "_attn_implementation_internal"


class HFDriver(LocalDriver):
    """Runs a transformers causal LM with the full canonical hook tree.

    Build it with ``HFDriver.boot(...)`` (what ``TransformerBridge.boot_transformers``
    calls). During each forward the driver points the model's attention implementation
    at its hooked eager attention, attaches torch hooks only for HookPoints that have
    something attached, and restores both afterwards.
    """

    name = "hf"
    #: Whether the driver loaded the model itself (only then may compatibility mode
    #: rewrite its weights; a user's ``hf_model`` is never mutated).
    _owns_model: bool = False
    _compat: CompatState | None = None

    def __init__(
        self,
        hf_model: nn.Module,
        adapter: ArchitectureAdapter,
        tokenizer: Tokenizer,
        *,
        use_attn_result: bool = False,
        n_ctx: int | None = None,
        info: ModelInfo | None = None,
    ) -> None:
        """Wrap a loaded model (see ``boot`` for the usual entry point).

        Args:
            hf_model: A transformers ``*ForCausalLM`` model of ``adapter``'s family.
            adapter: The family's adapter.
            tokenizer: The tokenizer (a tl ``Tokenizer``).
            use_attn_result: Also serve ``attn.hook_result``.
            n_ctx: The longest input to accept (default: the config's).
            info: The model's ``ModelInfo`` (default: the adapter's description's reading of
                the config; inferred architectures pass theirs).

        Raises:
            ConfigError: The model lacks a module the adapter names.
        """
        config = hf_model.config
        info = info if info is not None else adapter.description.model_info(config)
        if n_ctx is not None:
            info = dataclasses.replace(info, n_ctx=n_ctx)
        # Meta parameters without accelerate's offload hooks mean load_weights=False; with
        # them (disk offload) the weights are brought in module by module as it runs.
        self._meta = any(p.is_meta for p in hf_model.parameters()) and not any(
            hasattr(m, "_hf_hook") for m in hf_model.modules()
        )
        #: How images reach the language stack (``None``: the model takes none, and why).
        self._vision, self._no_images, self._grouped_pixels = read_vision(
            hf_model, config, measure=not self._meta
        )
        if self._vision is not None:
            info = dataclasses.replace(info, reads_images=True)
        self._hf_model = hf_model
        self._info = info
        self._modules = resolve_modules(hf_model, adapter)
        self._absent = {
            t.format(i=i) if "{i}" in t else t: reason
            for t, reason in adapter.absent_templates().items()
            for i in range(info.n_layers)
        }
        names = [
            n
            for n in canonical_hook_names(
                info, include_attn_result=use_attn_result, include_split_qkv_input=True
            )
            if n not in self._absent
        ]
        self._tokenizer = tokenizer
        self._adapter = adapter
        #: Whether forwards route attention through tl's hooked attention function (off
        #: for an inferred architecture whose attention that function cannot reproduce).
        self._hooked_attention = True
        self._certification: Certification | None = None
        self._inferred: InferredArchitecture | None = None
        #: Why the readout is refused (certification found it does not give the logits).
        self._readout_refused: str | None = None
        self._arena = CaptureArena()
        self._build(names)
        self._configs = configs_of(hf_model)

    def _build(self, names: list[str]) -> None:
        """The HookPoint tree and its wiring for ``names`` (rebuilt after certification)."""
        info = self._info
        self._model = HFHookedModel(self._hf_model, self._adapter, info, self._modules, names)
        self._wiring = Wiring(
            self._modules,
            self._model.hook_points,
            self._adapter,
            n_heads=info.n_heads,
            n_kv_heads=info.kv_heads,
            d_head=info.d_head,
            parallel=info.parallel_attn_mlp,
            arena=self._arena,
        )
        self._sites = self._wiring.attention_sites()

    @property
    def certification(self) -> Certification | None:
        """The certification report of the boot (``None`` when booted with ``certify=False``
        or without weights); ``certify()`` runs it again on demand."""
        return self._certification

    def certify(self, *, thorough: bool = True) -> Certification:
        """Run the certification checks now on the booted model and return the report.

        Serves nothing new and hides nothing: the served hooks stay as they are (at boot,
        only certified hooks were served).

        Args:
            thorough: Every check (the default here, and at the boot of an inferred
                architecture): plain transformers as the reference, the attention direction, edits
                against plain torch hooks, weights. ``False`` is what the boot of a
                described family runs: the equations over tl's own capture.

        Raises:
            UserError: The model was booted without weights.
        """
        self._check_runnable()
        return certify_driver(
            self,
            model=self._name,
            inferred=self._inferred is not None,
            description=self._describe(),
            thorough=thorough,
        )

    _name: str = "<model>"

    def _describe(self) -> dict[str, str]:
        if self._inferred is not None:
            return dict(self._inferred.facts)
        return {"layers": f"{self._adapter.layers} ({self._info.n_layers} blocks)"}

    @property
    def architecture(self) -> Architecture:
        """The booted model's engine-independent description (block form, norms, attention
        and MLP variants, unembedding): ``tl_core.architecture.Architecture``, its family's
        description (or the inferred one) read against its config."""
        config: Any = self._hf_model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        described = self._adapter.description.architecture(config, self._info)
        if self._vision is None:
            return described
        return dataclasses.replace(described, vision=self._vision)

    @classmethod
    def boot(cls, model_name: Any = None, **options: Any) -> HFDriver:
        """Load a transformers model (or wrap one) for tl.

        Args:
            model_name: A hub id, a local folder, or a GGUF file (``"model.gguf"``, or a
                folder plus ``gguf_file=``; needs ``tl-driver-hf[gguf]``), or ``None`` with
                ``hf_model``. A name written as a path (absolute, ``./``/``../``, ``~``;
                ``~`` is expanded) must exist: it is never looked up on the hub.
            **options: ``hf_config_overrides`` (config fields to change),
                ``device`` or ``device_map`` (``"auto"``, a dict, ...; mutually exclusive),
                ``offload_folder`` and ``max_memory`` (with ``device_map``),
                ``n_devices`` (split layers over the first n CUDA devices),
                ``dtype`` (default float32), ``tokenizer`` (object, hub id or folder),
                ``load_weights`` (``False``: build on the meta device, for inspection),
                ``trust_remote_code`` (default False), ``model_class`` (class or its name
                in transformers), ``hf_model`` (wrap a loaded model as is; tl has no load
                report for it, so its weights are not checked), ``n_ctx``,
                ``revision``, ``checkpoint_index``/``checkpoint_value`` (Pythia and
                stanford-crfm training checkpoints), ``use_attn_result``,
                ``gguf_file`` (the GGUF file's name inside the ``model_name`` folder),
                ``certify`` (default True: prove every hook on the booted model before
                serving it, see ``certification``; False skips it for a described family and
                is refused for an inferred one). A
                GGUF file is dequantised once, in ``dtype``, into a cached safetensors
                folder (``tl_core.gguf.gguf_cache_dir``) that later boots reuse; to
                load one through transformers alone, pass ``hf_model=`` and ``tokenizer=``.

        An architecture no adapter describes is inferred from its module tree, certified,
        and served as far as certification proves it (at least the residual stream), with
        one log line saying so; one whose inferred description does not reproduce the model
        is refused.

        Returns:
            The driver.

        Raises:
            UserError: Unknown or conflicting options, a model without checkpoints, a
                path that does not exist or a file that is no folder (for ``model_name``
                and ``tokenizer``), an unsupported architecture or a CUDA/MPS device this
                torch cannot use (``ConfigError``), all before any weight loads; after
                loading, a checkpoint whose weights do not fit the model transformers
                builds (missing, in other shapes, or with no place in it: ``ConfigError``
                naming them).
        """
        opts = BootOptions.parse(model_name, options)
        if opts.hf_model is not None and is_encoder_decoder(opts.hf_model):
            name = str(getattr(opts.hf_model, "name_or_path", "") or type(opts.hf_model).__name__)
            return boot_seq2seq(opts, model=opts.hf_model, name=name)  # type: ignore[return-value]
        if signal_reads(opts.hf_model) is not None:
            name = str(getattr(opts.hf_model, "name_or_path", "") or type(opts.hf_model).__name__)
            return boot_signal(opts, model=opts.hf_model, name=name)  # type: ignore[return-value]
        if opts.hf_model is not None:
            model = opts.hf_model
            adapter = adapter_or_none(getattr(model, "config", None), opts, type(model).__name__)
            source = opts.tokenizer
            if source is None:
                source = getattr(model, "name_or_path", None) or None
            tokenizer = load_tokenizer(
                source, model.config, local_only=True, required=isinstance(opts.tokenizer, str)
            )
            name = str(getattr(model, "name_or_path", "") or type(model).__name__)
            return cls._assemble(model, adapter, tokenizer, opts, name)
        opts = gguf_folder(opts)
        config = load_config(opts)
        if opts.model_class is None and lm_kind(config) == "seq2seq":
            return boot_seq2seq(opts, config)  # type: ignore[return-value]
        if opts.model_class is None and lm_kind(config) in SIGNAL_KINDS:
            return boot_signal(opts, config)  # type: ignore[return-value]
        adapter = adapter_or_none(config, opts, built_class(config, opts))
        if opts.n_ctx is not None and adapter is not None:
            apply_n_ctx(config, adapter, opts.n_ctx)
        model = load_model(opts, config, adapter)
        tokenizer = load_tokenizer(
            opts.tokenizer if opts.tokenizer is not None else opts.model_name,
            config,
            revision=opts.revision if opts.tokenizer is None else None,
            trust_remote_code=opts.trust_remote_code,
            required=opts.tokenizer is not None,
        )
        driver = cls._assemble(model, adapter, tokenizer, opts, str(opts.model_name))
        driver._owns_model = True
        return driver

    @classmethod
    def _assemble(
        cls,
        model: nn.Module,
        adapter: ArchitectureAdapter | None,
        tokenizer: Tokenizer,
        opts: BootOptions,
        name: str,
    ) -> HFDriver:
        """The driver over a loaded model: described, or inferred; certified unless turned off."""
        inferred = None
        if adapter is None:
            inferred = infer_architecture(model)
            adapter = inferred.adapter
        info = inferred.info if inferred is not None else None
        if adapter.description.kind == "masked_lm" and isinstance(tokenizer, HFTokenizer):
            # An encoder reads [CLS] text [SEP]: bridges close each prompt as its template does.
            tokenizer = HFTokenizer(tokenizer.hf_tokenizer, close_prompts=True)
        driver = cls(
            model,
            adapter,
            tokenizer,
            use_attn_result=opts.use_attn_result,
            n_ctx=opts.n_ctx,
            info=info,
        )
        driver._inferred = inferred
        driver._name = name
        if (opts.certify or inferred is not None) and not driver._meta:
            facts = BootFacts(
                name=name,
                architecture=driver._info.architecture,
                family=driver._adapter.family,
                layers=driver._adapter.layers,
                inferred=inferred is not None,
            )
            driver._apply(certify_at_boot(driver, facts))
        return driver

    @property
    def candidate_hooks(self) -> list[str]:
        """Every hook built now (before certification: every one the modules offer)."""
        return list(self._model.hook_points)

    def certify_serving(
        self,
        names: Sequence[str] | None,
        *,
        hooked_attention: bool,
        absent: Mapping[str, str],
        thorough: bool,
    ) -> Certification:
        """Serve ``names`` (``None``: as built) with tl's attention or the model's, and certify
        that (a trial of the boot's certification, ``CertificationTrials``)."""
        self._hooked_attention = hooked_attention
        if names is not None:
            self._absent.update(absent)
            self._build(list(names))
        return self.certify(thorough=thorough)

    def _apply(self, decision: BootDecision) -> None:
        """Serve what the boot's certification decided."""
        self._hooked_attention = decision.hooked_attention
        self._absent.update(decision.absent)
        # A residual-only stage was certified as built: build again only when hooks dropped.
        if decision.served is not None and decision.served != self.candidate_hooks:
            self._build(decision.served)
        self._certification = decision.certification
        self._readout_refused = decision.readout_refused
        self._model.refused_weights.update(decision.refused_weights)

    def enable_compatibility_mode(self, **options: Any) -> None:
        """Rewrite the weights to HookedTransformer's processed-weights convention.

        Folds norms into the layers reading them, centres the residual-stream writers
        (LayerNorm models), centres the unembedding and folds value biases (see
        ``packages/tl-driver-hf/docs/driver.md``). Logits change only by a per-position constant (not at all
        under final-logit soft-capping, where the unembedding is not centred).

        Args:
            **options: ``fold_ln``, ``center_writing_weights``, ``center_unembed``,
                ``fold_value_biases`` (bools, all ``True`` by default).

        Raises:
            UserError: The model was passed in as ``hf_model`` (it is never mutated),
                compatibility mode is already on, or an option is unknown.
            UnsupportedFeatureError: A structure that cannot be folded (the message names
                the family's norms and what reads them) or an offloaded model.
        """
        if not self._owns_model:
            raise UserError(
                "enable_compatibility_mode() rewrites the model's weights, and this model was "
                "passed in by you (hf_model / build_bridge_from_module), which the driver never "
                "mutates. Boot it with TransformerBridge.boot_transformers(<name or folder>) "
                "to use compatibility mode."
            )
        if self._compat is not None:
            raise UserError(
                f"compatibility mode is already enabled ({self._compat}); it can be applied once"
            )
        if self._inferred is not None:
            raise UnsupportedFeatureError(
                f"enable_compatibility_mode() folds weights along a family's hand-checked "
                f"description (each is compared with TransformerLens in CI); "
                f"{self._info.architecture!r} was inferred from its modules, so its folding is "
                f"not verified. Use the model as loaded, or describe the family "
                f"(docs/adding-a-family.md)."
            )
        self._check_runnable()
        info = self.info
        self._compat = enable_compatibility(
            self.hf_model,
            self._model.parts,
            self._adapter,
            n_heads=info.n_heads,
            n_kv_heads=info.kv_heads,
            d_head=info.d_head,
            parallel=info.parallel_attn_mlp,
            **options,
        )

    @property
    def compatibility_mode(self) -> CompatState | None:
        """What ``enable_compatibility_mode`` applied, or ``None`` when it was not called."""
        return self._compat

    # -- LocalDriver ------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The ``HFHookedModel`` (HookPoint tree, weights, and ``hf_model``)."""
        return self._model

    @property
    def capture_arena(self) -> CaptureArena:
        """The buffers the driver reuses for the logits, the attention scores, pattern and
        ``z``, and RMS norms' normalized values (on the CPU, without gradients): it keeps the
        last forward's, and writes into them again once nothing else holds them;
        ``capture_arena.clear()`` frees them (``docs/cache.md``)."""
        return self._arena

    @property
    def hooked_model(self) -> HFHookedModel:
        """The ``HFHookedModel`` (as ``module``, typed)."""
        return self._model

    @property
    def hf_model(self) -> nn.Module:
        """The wrapped transformers model."""
        return self._model.hf_model

    @property
    def adapter(self) -> ArchitectureAdapter:
        """The family's adapter."""
        return self._adapter

    @property
    def hook_points(self) -> Mapping[str, HookPoint]:
        """Canonical name -> HookPoint of every site this model fires."""
        return self._served(self._model.hook_points)

    def _apply_split_qkv_input(self, enabled: bool) -> None:
        self._wiring.split_qkv_input = enabled

    @property
    def info(self) -> ModelInfo:
        """The model's sizes and structure."""
        return self._model.info

    @property
    def tokenizer(self) -> Tokenizer:
        """The wrapped tokenizer."""
        return self._tokenizer

    @property
    def read_only_reasons(self) -> Mapping[str, str]:
        """Served hooks that take no specs: a mixture of experts' router logits."""
        if not self._adapter.description.moe:
            return {}
        return {
            f"blocks.{i}.mlp.hook_router_logits": ROUTER_LOGITS_READ_ONLY.format(i=i)
            for i in range(self.info.n_layers)
        }

    @property
    def absent_reasons(self) -> Mapping[str, str]:
        """Canonical hooks this family lacks despite its ``ModelInfo``, with the reason."""
        return self._absent

    @property
    def device(self) -> torch.device:
        """Where inputs go: the first parameter that is not offloaded."""
        for param in self.hf_model.parameters():
            if not param.is_meta:
                return param.device
        return torch.device("cpu")

    def readout(self) -> ModelReadout:
        """Final norm and unembedding.

        Raises:
            UnsupportedFeatureError: Certification found that they do not give the model's
                logits (a logit scale applied after the unembedding, a head transform).
        """
        if self._readout_refused is not None:
            raise UnsupportedFeatureError(
                f"the final norm and unembedding of {self._info.architecture!r} do not give its "
                f"logits ({self._readout_refused}), so tl serves no readout of the residual "
                f"stream (logit lens, direct logit attribution)"
            )
        return self._model.readout()

    @functools.cached_property
    def _numbers_positions_from_zero(self) -> bool:
        """Whether the model has a learned position table whose ids start at 0 for each
        prompt, and its forward takes ``position_ids``."""
        if self._adapter.pos_embed is None or self._adapter.position_ids_start:
            return False
        return "position_ids" in inspect.signature(self.hf_model.forward).parameters

    @property
    def _token_types(self) -> int:
        """How many segment ids the model's token-type embedding has (0: none)."""
        config: Any = self.hf_model.config
        count = getattr(config, "type_vocab_size", None)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            return 0
        accepts = inspect.signature(self.hf_model.forward).parameters
        return count if "token_type_ids" in accepts else 0

    def supports(self, feature: str) -> bool:
        """As ``LocalDriver.supports``; ``"token_type_ids"`` where the model has a token-type
        embedding (BERT-style encoders), ``"images"`` where it reads images and no image
        check of its certification failed (vision-language models)."""
        if feature == "token_type_ids":
            return self._token_types > 0
        if feature == "images":
            return self.images_refused is None
        return super().supports(feature)

    def pixel_values(self, images: Sequence[Any]) -> torch.Tensor:
        """``[n, channels, height, width]`` pixels of images given as PIL images, arrays or
        file paths, as the checkpoint's own image processor prepares them.

        Raises:
            UserError: The checkpoint holds no image processor (pass pixel tensors then), a
                path that is no image, or images the processor refuses.
        """
        processor, why = self._image_processor
        if processor is None:
            raise UserError(
                f"images= holds images that are not pixel tensors, and {why}: pass "
                "[channels, height, width] pixel tensors as the model's processor makes them, "
                "or save its image processor in the checkpoint folder"
            )
        return processed_pixels(processor, images)

    @functools.cached_property
    def _image_processor(self) -> tuple[Any | None, str]:
        source = getattr(self._hf_model, "name_or_path", None) or self._name
        return load_image_processor(str(source))

    @property
    def grouped_pixels(self) -> bool:
        """Whether the model takes its images as one list ``[1, n, c, h, w]`` (Idefics2
        and 3, SmolVLM) rather than ``[n, c, h, w]`` (see ``model_pixels``)."""
        return self._grouped_pixels

    @property
    def images_refused(self) -> str | None:
        """Why this model takes no images from tl, or ``None`` when it takes them."""
        if self._vision is None:
            return self._no_images
        if not isinstance(self._vision.tokens_per_image, int):
            return "it was booted without weights, so tl did not measure an image's positions"
        failed = [
            c
            for c in (self._certification.checks if self._certification is not None else ())
            if c.equation in IMAGE_EQUATIONS and not c.passed
        ]
        if failed:
            return f"its certification failed {failed[0].line()}"
        return None

    @property
    def masks_padding(self) -> bool:
        """Whether the model attends both ways (an encoder), so padding must be masked."""
        stacks = self._adapter.description.stacks
        return bool(stacks) and stacks[0].attention == "bidirectional"

    def run(self, request: ForwardRequest) -> ForwardResult:
        """As ``LocalDriver.run``; refuses a model booted without weights first, and
        generation from a masked LM."""
        self._check_runnable()
        types = request.token_type_ids
        if types is not None and types.numel() and int(types.max()) >= self._token_types:
            raise UserError(
                f"token_type_ids must lie in [0, {self._token_types}) (the model's "
                f"type_vocab_size), got {int(types.max())}"
            )
        if request.decodes and self._adapter.description.kind == "masked_lm":
            raise UnsupportedFeatureError(
                f"{self._info.architecture!r} is a masked LM: it predicts each position's own "
                f"(masked) token, not a next one, so there is nothing to generate. Read its "
                f"predictions from the logits of run_with_cache or the bridge's forward, at "
                f"the positions holding the mask token"
            )
        return super().run(request)

    def run_model(
        self,
        input_ids: torch.Tensor | None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        residual: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        images: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward of the transformers model with the attached hooks.

        Block indices come checked (``LocalDriver.run_model``); ``residual`` with them.
        ``token_type_ids`` and ``images`` (pixels, checked by ``ForwardRequest``) go to
        models that take them.
        """
        self._check_runnable()
        start, stop = start_at_layer, stop_at_layer
        if start is None:
            ids = self._check_ids(input_ids)
            batch, seq = ids.shape
            device = ids.device
        else:
            assert residual is not None
            batch, seq = residual.shape[:2]
            device = residual.device
        mask = attention_mask.to(device) if attention_mask is not None else None
        if mask is None and self._inferred is not None and start is None:
            # Some families build their masks from it unconditionally (MPT).
            mask = torch.ones((batch, seq), dtype=torch.long, device=device)
        # An encoder's prompts are right-padded and it numbers positions its own way: its
        # own numbering holds. BERT's is 0, 1, ... for every row, padding included, read
        # from a one-row buffer: passing the same ids with the batch axis makes its position
        # sites fire per prompt like every other site. RoBERTa's (after its padding id)
        # already has the batch axis, and stays None.
        encoder = self._adapter.description.kind == "masked_lm"
        if position_ids is None and encoder and self._numbers_positions_from_zero:
            position_ids = torch.arange(seq, device=device).expand(batch, seq)
        elif position_ids is None and not encoder:
            # Explicit [batch, pos] ids: left padding needs them from the mask, and learned
            # position embeddings then fire with the batch axis like every other hook.
            if mask is not None:
                position_ids = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
            else:
                position_ids = torch.arange(seq, device=device).expand(batch, seq)
            if self._adapter.position_ids_start:
                # RoBERTa numbers positions after its padding id.
                position_ids = position_ids + self._adapter.position_ids_start
        elif position_ids is not None and position_ids.ndim == 1:
            position_ids = position_ids.to(device).expand(batch, seq)
        if start is not None:
            assert residual is not None
            return self._run_from(residual, start, stop, mask, position_ids)
        with self._session():
            handle = None
            if stop is not None:
                parts = self._model.parts
                target = parts.layers[stop].layer if stop < self.info.n_layers else parts.final_norm
                if target is not None:
                    handle = target.register_forward_pre_hook(
                        stopper, with_kwargs=True, prepend=True
                    )
                else:  # no final norm: the stream ends at the last block's output
                    handle = parts.layers[-1].layer.register_forward_hook(stop_after)
            extra: dict[str, Any] = {}
            if token_type_ids is not None:
                extra["token_type_ids"] = token_type_ids.to(device)
            if images is not None:
                dtype = next(self.hf_model.parameters()).dtype
                extra["pixel_values"] = model_pixels(images, self._grouped_pixels).to(device, dtype)
            try:
                out = self.hf_model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=position_ids,
                    use_cache=False,
                    **extra,
                )
            except Stop as stopped:
                return stopped.value  # type: ignore[no-any-return]
            finally:
                if handle is not None:
                    handle.remove()
        return out.logits  # type: ignore[no-any-return]

    # -- internals --------------------------------------------------------------------

    def _check_runnable(self) -> None:
        if self._meta:
            raise UserError(
                "this model was booted with load_weights=False: its parameters live on the "
                "meta device and hold no values, so it cannot run. Use it to inspect the "
                "config, hook names and shapes, or boot again with load_weights=True."
            )

    def _check_ids(self, input_ids: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            found = (
                tuple(input_ids.shape)
                if isinstance(input_ids, torch.Tensor)
                else type(input_ids).__name__
            )
            raise UserError(f"input_ids must be a 2-D tensor [batch, pos], got {found}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
            raise UserError(f"input_ids must hold integers, got dtype {input_ids.dtype}")
        rows = int(cast(torch.Tensor, self._model.parts.embed.weight).shape[0])
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= rows):
            raise UserError(
                f"input_ids must lie in [0, {rows}) (the embedding's rows), got values from "
                f"{int(input_ids.min())} to {int(input_ids.max())}"
            )
        if self._adapter.pos_embed is not None and input_ids.shape[1] > self.info.n_ctx:
            raise UserError(
                f"sequence length {input_ids.shape[1]} exceeds n_ctx={self.info.n_ctx}; this "
                f"model has learned positions, so longer inputs cannot run"
            )
        return input_ids

    @contextmanager
    def _session(self, *, wire: bool = True) -> Iterator[ForwardBookkeeping]:
        """Hooked attention and the needed torch hooks for one forward; all undone after.

        ``wire=False`` is a forward no hook may see (``_run_from``'s probe): the attention
        implementation is tl's, so transformers builds the same masks, but no site fires.
        """
        saved = [(cfg, getattr(cfg, _IMPL_ATTR, None)) for cfg in self._configs]
        state = ForwardBookkeeping()
        handles = []
        sites = self._sites if wire else {}
        try:
            for cfg, _ in saved:
                if self._hooked_attention:
                    setattr(cfg, _IMPL_ATTR, ATTN_IMPLEMENTATION)
            with (
                attention_sites(sites),
                inline_attention(sites, self._adapter),
                self._arena.forward(),
                head_into_arena(self._modules.lm_head, self._arena),
            ):
                if wire:
                    handles = self._wiring.install(state)
                yield state
        finally:
            for handle in handles:
                handle.remove()
            for cfg, value in saved:
                setattr(cfg, _IMPL_ATTR, value)

    def _run_from(
        self,
        residual: torch.Tensor,
        start: int,
        stop: int | None,
        mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run blocks ``start..stop`` on ``residual``, then the head unless stopping early.

        A probe forward (no tl hooks) captures the exact arguments transformers passes to
        block ``start`` (masks, rotary tables per layer type), which the blocks then get.
        """
        parts = self._model.parts
        n_layers = len(parts.layers)
        end = n_layers if stop is None else stop
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        if start < end:
            with self._session(wire=False):
                handle = parts.layers[start].layer.register_forward_pre_hook(
                    prober, with_kwargs=True, prepend=True
                )
                try:
                    dtype = cast(torch.Tensor, parts.embed.weight).dtype
                    embeds = residual.detach().to(dtype)
                    self.hf_model(
                        inputs_embeds=embeds,
                        attention_mask=mask,
                        position_ids=position_ids,
                        use_cache=False,
                    )
                except Stop as probe:
                    args, kwargs = probe.call_args, probe.call_kwargs
                finally:
                    handle.remove()
        x = residual
        with self._session():
            for layer in parts.layers[start:end]:
                call_args, call_kwargs = _with_input(args, kwargs, x)
                out = layer.layer(*call_args, **call_kwargs)
                x = out[0] if isinstance(out, tuple) else out
            if stop is not None:
                return x
            if self._adapter.readout_opaque:
                raise UnsupportedFeatureError(
                    f"start_at_layer runs on to the logits through {self._info.architecture!r}'s "
                    f"head transform, which tl does not run from a residual it is handed; pass "
                    f"stop_at_layer to get the residual stream instead"
                )
            logits = parts.lm_head(parts.final_norm(x) if parts.final_norm is not None else x)
        return self._softcap(logits)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        field = self._adapter.description.final_softcap
        cap = getattr(self.hf_model.config, field, None) if field else None
        if cap is None:
            return logits
        return torch.tanh(logits / float(cap)) * float(cap)
