"""Check that every family is described once, in tl-core, and that no engine table restates it.

Three tables name model families: tl-core's descriptions (``tl_core.architecture``, every
engine-independent fact), the hf driver's adapters (``tl_driver_hf.adapters``, transformers'
module paths) and the vllm driver's layouts (``tl_driver_vllm._families``, vLLM's module
paths). This script lists the families each table names and reports, one line each:

* a family described twice in tl-core (a name, ``model_type`` or class name in two rows);
* an engine row that names no description tl-core holds (the hf adapter's ``description``
  is not tl-core's row of its family; a vLLM architecture tl-core does not describe);
* an engine row whose paths disagree with its description (a norm path where the
  description has no norm, ...);
* a fact of the description written in an engine table: a field of the row class named as a
  ``FamilyDescription`` field, or any field that is neither a module path (``str`` or
  ``str | None``) nor declared below as the engine's own, with the reason it is.

Usage: ``python scripts/check_families.py`` (exit 1 when something is reported). It needs
tl-core, tl-driver-hf and tl-driver-vllm installed (vLLM itself is not imported); the docs
session runs its test (``scripts/tests/test_check_families.py``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from tl_core.architecture import FamilyDescription, all_families, family_description

#: Fields of the hf driver's ``ArchitectureAdapter`` that are neither module paths nor facts
#: of the description, with why they belong to the engine.
HF_ENGINE_FIELDS: dict[str, str] = {
    "description": "the reference to the family's description",
    "shared_parts": "module paths (gate, up, down) inside the shared expert",
    "qk_norm_layout": "how transformers' QK-norm modules see queries and keys",
    "linear": "transformers' weight layout of the projections (nn.Linear or GPT-2's Conv1D)",
    "softmax_fp32": "the dtype of transformers' eager softmax",
    "absent": "sites transformers' modules hide from the hf driver",
    "verified": "whether the hf driver's suite checks the family hook by hook",
    "qkv_layout": "how transformers packs a fused projection",
    "query_prescaled": "transformers' attention module scales queries before attention",
    "pos_offset": "rows of transformers' position table before position 0",
    "position_ids_start": "the position id transformers' embedding gives a prompt's first token",
    "mlp_inline": "transformers' MLP projections sit in the layer",
    "flat_mlp": "transformers' layer flattens positions before its MLP",
    "rotary_in_attention": "transformers hands attention its rotary table as an argument",
    "inline_attention": "transformers computes attention inside the module",
    "sublayers_add_residual": "transformers' sublayer modules add the residual",
    "mlp_out_inplace": "transformers' layer adds into the MLP output in place",
    "readout_opaque": "the hf driver's probe found no one final norm before the unembedding",
}

#: Fields of the vllm driver's ``Layout`` that are neither module paths nor facts of the
#: description, with why they belong to the engine.
VLLM_ENGINE_FIELDS: dict[str, str] = {
    "residual_pair": "vLLM's layers pass (delta, residual) pairs",
    "layer_input": "the position of the hidden states among a vLLM layer's arguments",
    "lm_head": "where vLLM's model keeps its unembedding",
    "qkv_layout": "how vLLM packs a fused projection",
    "qk_norm_layout": "how vLLM's QK-norm modules see queries and keys",
    "vllm_requires": "configs vLLM's model class cannot run (the description's are its own)",
    "backend": "vLLM's own model class or its Transformers backend",
    "partial_outputs": "vLLM's tensor-parallel partial sums",
    "activation": "an activation vLLM's class computes differently from the checkpoint",
    "residual_offset": "where a vLLM layer takes its residual argument",
    "attn_input": "where vLLM's attention module takes its hidden states",
    "withheld": "sites the vllm driver does not serve to match the hf driver",
}

_PATH_TYPES = ("str", "str | None")


def row_problems(
    row: type, engine_fields: Mapping[str, str], table: str
) -> list[str]:  # fmt: skip
    """Fields of an engine row class that restate, or may restate, a description's fact."""
    facts = {f.name for f in dataclasses.fields(FamilyDescription)}
    found = []
    for f in dataclasses.fields(row):
        if f.name in facts:
            found.append(
                f"{table}: {row.__name__}.{f.name} is a fact of the family's description "
                f"(FamilyDescription.{f.name}); read it from the description instead"
            )
        elif f.name not in engine_fields and str(f.type) not in _PATH_TYPES:
            found.append(
                f"{table}: {row.__name__}.{f.name} ({f.type}) is neither a module path nor a "
                f"declared fact of the engine; if it says what the family is, it belongs in "
                f"tl_core.architecture.FamilyDescription, else declare why it is the engine's "
                f"in scripts/check_families.py"
            )
    for name in engine_fields:
        if name not in {f.name for f in dataclasses.fields(row)}:
            found.append(f"{table}: {name!r} is declared but {row.__name__} has no such field")
    return found


def description_problems(descriptions: Iterable[FamilyDescription]) -> list[str]:
    """Families described twice: a name, ``model_type`` or class name in two rows."""
    found = []
    for key in ("family", "model_types", "architectures"):
        owner: dict[str, str] = {}
        for d in descriptions:
            values = getattr(d, key)
            for value in (values,) if isinstance(values, str) else values:
                if value in owner:
                    found.append(
                        f"tl-core: {key} {value!r} is described twice ({owner[value]!r} and "
                        f"{d.family!r})"
                    )
                owner[value] = d.family
    return found


def hf_problems(adapters: Iterable[Any], descriptions: Iterable[FamilyDescription]) -> list[str]:
    """hf adapters whose description is not tl-core's row of their family."""
    known = list(descriptions)
    return [
        f"hf: the {adapter.family!r} adapter's description is not tl-core's row of its family "
        f"(describe the family in tl_core.architecture and refer to it with family_named)"
        for adapter in adapters
        if not any(adapter.description == d for d in known)
    ]


def vllm_problems(
    layouts: Mapping[str, Any], find: Any = family_description, agree: Any = None
) -> list[str]:  # fmt: skip
    """vLLM rows that name no tl-core description, or whose paths disagree with it."""
    found = []
    for architecture, layout in sorted(layouts.items()):
        description = find(architectures=(architecture,))
        if description is None:
            found.append(f"vllm: the row for {architecture!r} names no tl-core description")
        elif agree is not None:
            found += [f"vllm: {architecture}: {p}" for p in agree(layout, description)]
    return found


def problems() -> list[str]:
    """What breaks "one description per family" in the tree, one line each."""
    from tl_driver_hf.adapters import ArchitectureAdapter, all_adapters
    from tl_driver_vllm._families import FAMILY_LAYOUTS, Layout, disagreements

    descriptions = all_families()
    return [
        *description_problems(descriptions),
        *row_problems(ArchitectureAdapter, HF_ENGINE_FIELDS, "hf"),
        *row_problems(Layout, VLLM_ENGINE_FIELDS, "vllm"),
        *hf_problems(all_adapters(), descriptions),
        *vllm_problems(FAMILY_LAYOUTS, agree=disagreements),
    ]


def tables() -> dict[str, list[str]]:
    """The families each table names."""
    from tl_driver_hf.adapters import all_adapters
    from tl_driver_vllm._families import FAMILY_LAYOUTS

    def family(architecture: str) -> str:
        found = family_description(architectures=(architecture,))
        return found.family if found is not None else f"<{architecture}: none>"

    return {
        "tl-core descriptions": sorted(d.family for d in all_families()),
        "hf adapters": sorted(a.family for a in all_adapters()),
        "vllm layouts": sorted({family(a) for a in FAMILY_LAYOUTS}),
    }


def main() -> int:
    """Print the tables' families and what breaks; return the exit code."""
    for table, families in tables().items():
        print(f"{table} ({len(families)}): {', '.join(families)}")
    found = problems()
    if found:
        print("a family is described more than once:", *found, sep="\n", file=sys.stderr)
        return 1
    print("one description per family")
    return 0


if __name__ == "__main__":
    sys.exit(main())
