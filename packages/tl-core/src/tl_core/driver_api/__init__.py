"""The driver-author API: everything a package needs to add an engine to tl.

Researchers use ``tl_core`` (bridges, caches, specs, hook names); a driver distribution
implements the ``Driver`` protocol with the pieces here and registers a ``DriverEntry``
under the ``tl_core.drivers`` entry-point group. Importing this package is cheap (no
torch), so a driver's entry-point module can import ``DriverEntry`` from it.

Sparse dictionaries spliced by researchers (``bridge.add_sae``) reach a driver as an
``Attachment``; a driver runs one inside its forward pass with ``DictionaryRun`` (or
``encode_and_decode`` and ``finish`` on the values at its sites).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core._dictionaries._dictionary import Linear as Linear
    from tl_core._dictionaries._run import (
        Attachment as Attachment,
        Decoded as Decoded,
        DictionaryRun as DictionaryRun,
        Visit as Visit,
        encode_and_decode as encode_and_decode,
        finish as finish,
    )
    from tl_core.cache._readout import ModelReadout as ModelReadout
    from tl_core.driver_api._batching import TokenBatch as TokenBatch, pad_batch as pad_batch
    from tl_core.driver_api._capabilities import (
        CertifyingDriver as CertifyingDriver,
        DescribingDriver as DescribingDriver,
        DictionaryDriver as DictionaryDriver,
        ReadoutDriver as ReadoutDriver,
        SplitQKVDriver as SplitQKVDriver,
        WeightFoldingDriver as WeightFoldingDriver,
    )
    from tl_core.driver_api._conformance import check_driver as check_driver
    from tl_core.driver_api._context import (
        fits_context as fits_context,
        most_new_tokens as most_new_tokens,
        positions_run as positions_run,
    )
    from tl_core.driver_api._counting import validation_calls as validation_calls
    from tl_core.driver_api._discovery import (
        DriverEntry as DriverEntry,
        EngineRequirement as EngineRequirement,
        InstalledDriver as InstalledDriver,
        available_drivers as available_drivers,
        clear_driver_cache as clear_driver_cache,
        get_driver_entry as get_driver_entry,
        load_driver_class as load_driver_class,
    )
    from tl_core.driver_api._images import (
        ImageInput as ImageInput,
        checked_images as checked_images,
        image_positions as image_positions,
        vision_of as vision_of,
        with_image_tokens as with_image_tokens,
    )
    from tl_core.driver_api._layers import block_index as block_index
    from tl_core.driver_api._local import LocalDriver as LocalDriver
    from tl_core.driver_api._norms import (
        apply_norm_weight as apply_norm_weight,
        centred_input as centred_input,
        norm_module_eps as norm_module_eps,
        norm_statistics as norm_statistics,
    )
    from tl_core.driver_api._paths import (
        checked_model_folder as checked_model_folder,
        checked_path as checked_path,
        looks_like_path as looks_like_path,
    )
    from tl_core.driver_api._protocol import (
        FEATURES as FEATURES,
        Driver as Driver,
        NamespaceFacts as NamespaceFacts,
        validate_driver as validate_driver,
    )
    from tl_core.driver_api._request import (
        LOCAL_OPTIONS as LOCAL_OPTIONS,
        ForwardRequest as ForwardRequest,
        ForwardResult as ForwardResult,
        LogitsWanted as LogitsWanted,
        RequestForward as RequestForward,
        build_request as build_request,
        logits_wanted as logits_wanted,
        partial_layers as partial_layers,
        planned_request as planned_request,
        run_keywords as run_keywords,
    )
    from tl_core.driver_api._sampling import (
        SamplingOptions as SamplingOptions,
        next_tokens as next_tokens,
    )
    from tl_core.driver_api._tokenizers import (
        ByteTokenizer as ByteTokenizer,
        HFTokenizer as HFTokenizer,
        Tokenizer as Tokenizer,
        detect_bos_eos as detect_bos_eos,
        padding_id as padding_id,
    )
    from tl_core.hooks._hook_point import HookPoint as HookPoint, only_rerouted as only_rerouted
    from tl_core.hooks._model_info import ModelInfo as ModelInfo
    from tl_core.hooks._namespace import HookNamespace as HookNamespace
    from tl_core.hooks._order import forward_order as forward_order
    from tl_core.hooks._resolution import (
        known_alias_templates as known_alias_templates,
        template_of as template_of,
    )
    from tl_core.hooks._vocabulary import (
        canonical_hook_names as canonical_hook_names,
        split_canonical as split_canonical,
    )
    from tl_core.specs._affine import (
        AffineEdit as AffineEdit,
        compile_plan as compile_plan,
        compile_specs as compile_specs,
    )
    from tl_core.specs._plan import InterventionPlan as InterventionPlan, build_plan as build_plan
    from tl_core.specs._specs import absolute_positions as absolute_positions

__getattr__, __dir__, __all__ = attach(__name__)
