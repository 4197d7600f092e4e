"""One description per family: the check holds on the tree and reports planted restatements."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

pytest.importorskip("tl_driver_hf.adapters")
pytest.importorskip("tl_driver_vllm._families")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import check_families

from tl_core.architecture import all_families, family_named


def test_the_tree_holds_and_every_engine_row_names_a_description() -> None:
    assert check_families.problems() == []
    tables = check_families.tables()
    described = set(tables["tl-core descriptions"])
    assert set(tables["hf adapters"]) <= described
    assert set(tables["vllm layouts"]) <= described
    # The fifteen families both engines serve by hand are described once, here.
    both = set(tables["hf adapters"]) & set(tables["vllm layouts"])
    assert len(both) == 15 and {"llama", "gemma2", "falcon", "opt", "bloom"} <= both


def test_a_fact_written_in_an_engine_row_is_reported() -> None:
    @dataclasses.dataclass(frozen=True)
    class Row:
        attn: str
        ln1: str | None
        norm: str  # the norm kind: a fact of the description
        parallel: bool  # another one
        fused_rope: bool  # neither a path nor declared

    found = check_families.row_problems(Row, {}, "toy")
    assert any("Row.norm is a fact of the family's description" in p for p in found)
    assert any("Row.parallel is a fact" in p for p in found)
    assert any("Row.fused_rope (bool) is neither a module path" in p for p in found)
    assert not any("Row.attn" in p or "Row.ln1" in p for p in found)
    declared = check_families.row_problems(Row, {"fused_rope": "why", "gone": "why"}, "toy")
    assert not any("fused_rope" in p for p in declared)
    assert any("'gone' is declared but Row has no such field" in p for p in declared)


def test_a_family_described_twice_or_not_at_all_is_reported() -> None:
    llama = family_named("llama")
    twice = dataclasses.replace(llama, family="llama-again", model_types=("llama2",))
    found = check_families.description_problems((*all_families(), twice))
    assert found == [
        "tl-core: architectures 'LlamaForCausalLM' is described twice ('llama' and 'llama-again')"
    ]

    @dataclasses.dataclass
    class Adapter:
        family: str
        description: object

    private = dataclasses.replace(llama, norm="layernorm")  # a copy that drifted
    assert check_families.hf_problems([Adapter("llama", private)], all_families()) == [
        "hf: the 'llama' adapter's description is not tl-core's row of its family (describe "
        "the family in tl_core.architecture and refer to it with family_named)"
    ]
    assert check_families.hf_problems([Adapter("llama", llama)], all_families()) == []
    assert check_families.vllm_problems({"NobodyForCausalLM": object()}) == [
        "vllm: the row for 'NobodyForCausalLM' names no tl-core description"
    ]
