"""Layouts read from the hf driver's description, for models on vLLM's Transformers backend.

vLLM runs many architectures (and every one it has no model class for) as transformers' own
modules with vLLM's layers swapped in: the module tree is transformers', except that the
base model sits at ``model``, separate query/key/value projections become one
``qkv_proj`` (``[q | k | v]``), separate gate and up projections one ``gate_up_proj``, and
each attention module gains vLLM's ``Attention`` layer as ``attn``. So the hf driver's
description of the architecture (its adapter, or the one it infers and certifies on a
shrunk copy) says where every site is, and no vLLM row is written. What the description
holds that these rules cannot place is refused here, naming it, before the engine starts;
what they place is certified on the booted engine (``_certify``) before it is served.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from tl_core import ConfigError
from tl_driver_vllm._driver_side._namespace import block_template
from tl_driver_vllm._families import (
    FAMILY_LAYOUTS,
    NOT_RUN_BY_VLLM,
    Layout,
    architecture_of,
    layout_for,
    resolve,
    settle,
)

__all__ = [
    "Backend",
    "Serving",
    "derived_layout",
    "layout_from_description",
    "serving_layout",
    "vllm_backend",
]

_LOG = logging.getLogger("tl_driver_vllm")

Backend = Literal["native", "transformers"]

#: Description fields these rules cannot place, with the reason.
_UNMAPPED: tuple[tuple[str, str], ...] = (
    (
        "moe",
        "a mixture of experts runs vLLM's fused experts there, whose routing sites tl does not map",
    ),
    (
        "embed_scaled",
        "the embedding scale is applied inside transformers' embedding, which vLLM replaces",
    ),
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
    """Place the sites of an hf description on vLLM's Transformers backend.

    Args:
        adapter: The hf driver's ``ArchitectureAdapter`` of the architecture (written or
            inferred).

    Returns:
        The layout (``backend="transformers"``).

    Raises:
        ConfigError: The description holds something these rules cannot place (each named).
    """
    problems = [why for name, why in _UNMAPPED if getattr(adapter, name)]
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
    return Layout(
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
        norm=adapter.norm,
        lm_head="lm_head",
        qkv="qkv_proj" if separate_qkv else adapter.qkv,
        qkv_layout="blocks" if separate_qkv else adapter.qkv_layout,
        attention="attn",
        o_proj=adapter.o,
        rotary="rotary_emb" if adapter.rotary else None,
        q_norm=adapter.q_norm,
        k_norm=adapter.k_norm,
        qk_norm_layout="flat" if adapter.qk_norm_layout == "flat" else "heads",
        gate_up=("gate_up_proj" if adapter.gate_up is None else adapter.gate_up)
        if adapter.gated
        else None,
        fc_in=None if adapter.gated else adapter.mlp_in,
        down=adapter.down,
        config_requires=dict(adapter.config_requires),
        embed_norm=embed_norm,
        parallel=adapter.parallel,
        parallel_field=adapter.parallel_field,
        backend="transformers",
    )


@dataclass(frozen=True)
class Serving:
    """How the vllm driver serves one checkpoint.

    Attributes:
        layout: Where vLLM keeps each site, settled for the checkpoint.
        model_impl: The ``model_impl`` tl asks vLLM for (``None``: vLLM's own choice).
        derived: Whether the layout was read from the hf driver's description (then the
            boot certifies it on the engine, always).
        withheld: Hook templates the hf driver did not certify for an inferred
            architecture, with its reason: not served on vLLM either.
        description: Facts for the certification report.
    """

    layout: Layout
    model_impl: str | None = None
    derived: bool = False
    withheld: dict[str, str] = field(default_factory=dict)
    description: dict[str, str] = field(default_factory=dict)


def _withheld(description: Any) -> dict[str, str]:
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


def _row_withheld(config: Any) -> dict[str, str]:
    """What a row must not serve because the hf driver does not: nothing for a family it
    describes by hand; for one it infers, what it did not certify on a shrunk copy (a name
    means the same tensor on both drivers, or is served by neither)."""
    from tl_driver_hf import describe_architecture
    from tl_driver_hf.adapters import find_adapter

    if (
        find_adapter(getattr(config, "model_type", None), getattr(config, "architectures", None))
        is not None
    ):
        return {}
    return _withheld(describe_architecture(config))


def derived_layout(config: Any) -> Serving:
    """How a checkpoint vLLM runs on its Transformers backend is served: its layout read
    from the hf driver's description of its architecture (inferred and certified on a
    shrunk copy when no family describes it).

    Raises:
        ConfigError: The hf driver does not serve the architecture with attention and MLP
            sites, or its description holds something vLLM's backend cannot place.
    """
    from tl_driver_hf import describe_architecture

    architecture = architecture_of(config)
    description = describe_architecture(config)
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
    return Serving(layout, derived=True, withheld=withheld, description=facts)


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
    if architecture in FAMILY_LAYOUTS and model_impl != "transformers":
        layout = resolve(config)
        facts = {
            "layout": f"tl's row for vLLM's {architecture} model class",
            "backend": "vLLM's own model class",
        }
        return Serving(layout, withheld=_row_withheld(config), description=facts)
    backend = vllm_backend(architecture, model_impl)
    if backend is None:
        layout_for(architecture)  # raises, with vLLM's reason
    serving = derived_layout(config)
    layout = settle(serving.layout, config)
    if backend == "native":
        _LOG.warning(
            "tl has no row for vLLM's own %s model class; running it on vLLM's Transformers "
            "backend (model_impl='transformers'), slower than vLLM's class, with its sites "
            "placed by the hf driver's description",
            architecture,
        )
    impl = "transformers" if backend == "native" else None
    return Serving(
        layout, impl, derived=True, withheld=serving.withheld, description=serving.description
    )
