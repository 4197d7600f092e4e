"""Layouts read from the hf driver's adapter, for models on vLLM's Transformers backend.

vLLM runs many architectures (and every one it has no model class for) as transformers' own
modules with vLLM's layers swapped in: the module tree is transformers', except that the
base model sits at ``model``, separate query/key/value projections become one
``qkv_proj`` (``[q | k | v]``), separate gate and up projections one ``gate_up_proj``, and
each attention module gains vLLM's ``Attention`` layer as ``attn``. So the hf driver's
adapter of the architecture (written, or inferred and certified on a shrunk copy) says where
every site is, with its family's description, and no vLLM row is written. What these rules
cannot place is refused here, naming it, before the engine starts; what they place is
certified on the booted engine (``_certify``) before it is served.

That path needs transformers' module tree as the hf driver reads it: tl-driver-hf, the
``transformers-backend`` extra, imported only here. Families with a row read their
description from tl-core and need nothing of it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from tl_core import ConfigError
from tl_core.architecture import FamilyDescription
from tl_driver_vllm._driver_side._namespace import block_template
from tl_driver_vllm._families import (
    FAMILY_LAYOUTS,
    NOT_RUN_BY_VLLM,
    Layout,
    architecture_of,
    disagreements,
    layout_for,
    resolve,
    settle,
)

if TYPE_CHECKING:
    from tl_driver_hf import ArchitectureDescription

__all__ = [
    "TRANSFORMERS_BACKEND_INSTALL",
    "Backend",
    "Serving",
    "derived_layout",
    "layout_from_description",
    "serving_layout",
    "vllm_backend",
]

_LOG = logging.getLogger("tl_driver_vllm")

Backend = Literal["native", "transformers"]

#: The line that installs what the Transformers-backend path needs.
TRANSFORMERS_BACKEND_INSTALL = 'pip install "tl-driver-vllm[transformers-backend]"'

#: Adapter fields these rules cannot place, with the reason.
_UNMAPPED: tuple[tuple[str, str], ...] = (
    ("sublayers_add_residual", "its sublayers add the residual themselves"),
    ("mlp_out_inplace", "its layer adds into the MLP output in place"),
    (
        "inline_attention",
        "its attention is computed inside its own module, not through vLLM's Attention",
    ),
    ("readout_opaque", "its unembedding reads something other than the final norm's output"),
    ("query_prescaled", "its attention scales queries before attention"),
    ("mlp_inline", "its MLP projections sit in the layer"),
    ("flat_mlp", "its layer flattens positions before the MLP"),
)


def vllm_backend(architecture: str, model_impl: str | None = None) -> Backend | None:
    """How vLLM 0.32 runs ``architecture``: its own model class, its Transformers backend,
    or ``None`` where it runs neither (a checkpoint vLLM names unsupported)."""
    if architecture in NOT_RUN_BY_VLLM:
        return None
    if model_impl == "transformers":
        return "transformers"
    from vllm.model_executor.models.registry import ModelRegistry

    entry = ModelRegistry.models.get(architecture)
    if entry is None:
        return "transformers"  # vLLM's "auto" falls back to the Transformers backend
    module = str(getattr(entry, "module_name", ""))
    return "transformers" if module.endswith(".transformers") else "native"


def _relative(path: str | None, base: str, what: str, problems: list[str]) -> str | None:
    if path is None:
        return None
    if not path.startswith(base + "."):
        problems.append(f"its {what} ({path!r}) is outside the base model {base!r}")
        return None
    return path[len(base) + 1 :]


def layout_from_description(adapter: Any) -> Layout:
    """Place the sites of an hf adapter on vLLM's Transformers backend.

    Args:
        adapter: The hf driver's ``ArchitectureAdapter`` of the architecture (written or
            inferred); its ``description`` is the family's.

    Returns:
        The layout (``backend="transformers"``); the description stays the adapter's.

    Raises:
        ConfigError: The adapter or its description holds something these rules cannot
            place (each named).
    """
    description: FamilyDescription = adapter.description
    problems = [why for name, why in _UNMAPPED if getattr(adapter, name)]
    if description.moe:
        problems.append(
            "a mixture of experts runs vLLM's fused experts there, whose routing sites tl does "
            "not map"
        )
    if description.norm_after_residual:
        problems.append(
            "its blocks normalise each residual sum (post-LN), where the vLLM sites read a "
            "residual stream that sublayers add to"
        )
    if description.embed_scaled:
        problems.append(
            "the embedding scale is applied inside transformers' embedding, which vLLM replaces"
        )
    if adapter.linear != "linear":
        problems.append(
            "its projections are GPT-2 Conv1D modules, which vLLM's backend does not fuse"
        )
    if adapter.final_norm is None:
        problems.append("it has no final norm module")
    if adapter.pos_offset:
        problems.append("its learned position table has an offset")
    if adapter.q_norm is not None and adapter.qk_norm_layout == "heads_first":
        problems.append("its QK-norms see heads before positions, which the vLLM sites do not read")
    base, _, layers = adapter.layers.partition(".")
    if not layers:
        problems.append(f"its layer list ({adapter.layers!r}) is not inside a base model")
    embed = _relative(adapter.embed, base, "embedding", problems)
    final_norm = _relative(adapter.final_norm, base, "final norm", problems)
    pos_embed = _relative(adapter.pos_embed, base, "position embedding", problems)
    embed_norm = _relative(adapter.embed_norm, base, "embedding norm", problems)
    if problems:
        raise ConfigError(
            f"the vllm driver cannot place tl's sites in {adapter.family!r} on vLLM's Transformers "
            f"backend: {'; '.join(problems)}. Use the hf driver for it."
        )
    assert embed is not None and final_norm is not None
    separate_qkv = adapter.qkv is None
    layout = Layout(
        inner="model",
        embed=embed,
        pos_embed=pos_embed,
        layers=layers,
        final_norm=final_norm,
        ln1=adapter.ln1,
        attn=adapter.attn,
        mlp=adapter.mlp,
        ln2=adapter.ln2,
        ln1_post=adapter.ln1_post,
        ln2_post=adapter.ln2_post,
        residual_pair=False,
        layer_input=0,
        lm_head="lm_head",
        qkv="qkv_proj" if separate_qkv else adapter.qkv,
        qkv_layout="blocks" if separate_qkv else adapter.qkv_layout,
        attention="attn",
        o_proj=adapter.o,
        rotary="rotary_emb" if description.rotary else None,
        q_norm=adapter.q_norm,
        k_norm=adapter.k_norm,
        qk_norm_layout="flat" if adapter.qk_norm_layout == "flat" else "heads",
        gate_up=("gate_up_proj" if adapter.gate_up is None else adapter.gate_up)
        if description.gated
        else None,
        fc_in=None if description.gated else adapter.mlp_in,
        down=adapter.down,
        embed_norm=embed_norm,
        backend="transformers",
    )
    wrong = disagreements(layout, description)
    if wrong:
        raise ConfigError(
            f"the vllm driver cannot place tl's sites in {adapter.family!r} on vLLM's Transformers "
            f"backend: its layout disagrees with its description ({'; '.join(wrong)}). Use the hf "
            "driver for it."
        )
    return layout


@dataclass(frozen=True)
class Serving:
    """How the vllm driver serves one checkpoint.

    Attributes:
        layout: Where vLLM keeps each site.
        family: The family's description, settled for the checkpoint
            (``FamilyDescription.settled``).
        model_impl: The ``model_impl`` tl asks vLLM for (``None``: vLLM's own choice).
        derived: Whether the layout was read from the hf driver's adapter (then the boot
            certifies it on the engine, always).
        withheld: Hook templates the layout places but the driver does not serve, with the
            reason (a row's ``withheld``; what the hf driver did not certify for an inferred
            architecture).
        facts: Facts for the certification report.
    """

    layout: Layout
    family: FamilyDescription
    model_impl: str | None = None
    derived: bool = False
    withheld: dict[str, str] = field(default_factory=dict)
    facts: dict[str, str] = field(default_factory=dict)


def _withheld(description: ArchitectureDescription) -> dict[str, str]:
    """Hook templates the hf driver's description lacks or did not certify, with the reason."""
    withheld = dict(description.adapter.absent)
    if description.certification is not None:
        for name, cert in description.certification.statuses.items():
            if cert.status == "uncertified":
                withheld.setdefault(
                    block_template(name),
                    f"uncertified on the hf driver's shrunk copy: {cert.reason}",
                )
    return withheld


def _describe(config: Any) -> ArchitectureDescription:
    """The hf driver's description of ``config``'s architecture.

    Raises:
        ConfigError: tl-driver-hf is not installed (naming the line that installs it).
    """
    try:
        from tl_driver_hf import describe_architecture
    except ImportError as exc:
        raise ConfigError(
            f"the vllm driver serves {architecture_of(config)!r} on vLLM's Transformers backend, "
            "where tl places its sites by the hf driver's reading of transformers' modules; "
            f"that needs tl-driver-hf, which is not installed ({exc}). Install it with: "
            f"{TRANSFORMERS_BACKEND_INSTALL}"
        ) from None
    return describe_architecture(config)


def derived_layout(config: Any) -> Serving:
    """How a checkpoint vLLM runs on its Transformers backend is served: its layout read
    from the hf driver's adapter of its architecture (inferred and certified on a shrunk
    copy when no family describes it).

    Raises:
        ConfigError: tl-driver-hf is not installed, the hf driver does not serve the
            architecture with attention and MLP sites, or its adapter holds something vLLM's
            backend cannot place.
    """
    architecture = architecture_of(config)
    description = _describe(config)
    if description.level != "full":
        raise ConfigError(
            f"the vllm driver cannot serve {architecture!r}: the hf driver certifies only its "
            f"{description.level} hooks (`tl certify MODEL` shows why), and vLLM's Transformers "
            "backend places sites by that description. Use the hf driver for it."
        )
    layout = layout_from_description(description.adapter)
    withheld = _withheld(description)
    how = ", inferred and certified on a shrunk copy" if description.inferred else ""
    facts = {
        "layout": f"sites placed by the hf driver's description of {description.adapter.family!r}{how}",
        "backend": "vLLM's Transformers backend",
    }
    return Serving(
        layout, description.adapter.description, derived=True, withheld=withheld, facts=facts
    )


def _refuse_masked_lm(architecture: str) -> None:
    """Refuse a masked LM (an encoder) before anything boots.

    Raises:
        ConfigError: ``architecture`` is a masked-LM class of transformers' and no causal LM
            (nor a sequence-to-sequence or image-text class, which the masked-LM mapping
            also lists: BART's ``ForConditionalGeneration``).
    """
    from transformers.models.auto import modeling_auto as auto

    def names(mapping: Any) -> set[str]:
        found: set[str] = set()
        for value in mapping.values():
            found.update((value,) if isinstance(value, str) else value)
        return found

    other_kinds = (
        auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )
    if architecture in names(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES).difference(
        *(names(m) for m in other_kinds)
    ):
        raise ConfigError(
            f"{architecture!r} is a masked LM (an encoder whose attention reads both ways): "
            "vLLM runs encoders for pooling (embeddings, classification), not as language "
            "models with logits at every position, so the vllm driver does not serve them. "
            "Boot it with the hf driver (boot_transformers), which serves masked LMs."
        )


def serving_layout(config: Any, model_impl: str | None = None) -> Serving:
    """How a checkpoint is served: its layout, and the ``model_impl`` tl must ask vLLM for.

    A family with a row runs on vLLM's own model class with it (unless ``model_impl`` is
    ``"transformers"``). Every other architecture runs on vLLM's Transformers backend, placed
    by the hf driver's description: where vLLM would pick its own model class for it, tl
    asks for the backend (``"transformers"``, with a log line: it is slower than vLLM's
    class, but tl knows where its sites are).

    Args:
        config: The checkpoint's ``transformers`` config.
        model_impl: The ``model_impl`` the user passed to vLLM, if any.

    Returns:
        The serving plan, with per-checkpoint fields of the layout settled.

    Raises:
        ConfigError: vLLM runs the architecture in neither way, the hf driver does not
            describe it fully, or its description cannot be placed (all named).
    """
    architecture = architecture_of(config)
    _refuse_masked_lm(architecture)
    if architecture in FAMILY_LAYOUTS and model_impl != "transformers":
        layout, family = resolve(config)
        facts = {
            "layout": f"tl's row for vLLM's {architecture} model class",
            "backend": "vLLM's own model class",
        }
        return Serving(layout, family, withheld=dict(layout.withheld), facts=facts)
    backend = vllm_backend(architecture, model_impl)
    if backend is None:
        layout_for(architecture)  # raises, with vLLM's reason
    serving = derived_layout(config)
    family = settle(serving.layout, serving.family, config)
    if backend == "native":
        _LOG.warning(
            "tl has no row for vLLM's own %s model class; running it on vLLM's Transformers "
            "backend (model_impl='transformers'), slower than vLLM's class, with its sites "
            "placed by the hf driver's description",
            architecture,
        )
    impl = "transformers" if backend == "native" else None
    return Serving(
        serving.layout, family, impl, derived=True, withheld=serving.withheld, facts=serving.facts
    )
