"""The tutorial runner fails on what it promises to catch (run by ``nox -s docs``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import run_tutorials

pytest.importorskip("matplotlib")

_DRAW = """import matplotlib.pyplot as plt
figure, axes = plt.subplots()
axes.plot([0, 1, 2], [2, 0, 1], linewidth=4)
figure.savefig("figures/line.png")
"""

_PAGE = f"""# A tutorial

```python
total = 0
for value in (1.5, 2.25):
    total += value
```

Shared state, like notebook cells:

```python
print(f"{{total:.2f}}", [1, 2])
```

```
3.75 [1, 2]
```

```python
{_DRAW}```

![a line](figures/line.png)
"""


@pytest.fixture
def tutorials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "tutorials"
    folder.mkdir()
    monkeypatch.setattr(run_tutorials, "TUTORIALS", folder)
    monkeypatch.setattr(run_tutorials, "FIGURES", folder / "figures")
    return folder


def test_a_current_page_passes_and_its_figure_is_copied(tutorials: Path) -> None:
    page = tutorials / "ok.md"
    page.write_text(_PAGE)
    assert run_tutorials.check(page, write=False) == []
    assert (tutorials / "figures" / "line.png").stat().st_size > 1000


def test_stale_output_is_reported_then_rewritten(tutorials: Path) -> None:
    page = tutorials / "stale.md"
    page.write_text(_PAGE.replace("3.75 [1, 2]", "3.70 [1, 2]"))
    problems = run_tutorials.check(page, write=False)
    assert len(problems) == 1 and "stale output" in problems[0] and "+3.75 [1, 2]" in problems[0]
    assert run_tutorials.check(page, write=True) == []
    assert page.read_text() == _PAGE


def test_last_digit_drift_is_tolerated_but_integers_are_not(tutorials: Path) -> None:
    page = tutorials / "drift.md"
    page.write_text(_PAGE.replace("3.75 [1, 2]", "3.76 [1, 2]"))
    assert run_tutorials.check(page, write=False) == []
    page.write_text(_PAGE.replace("3.75 [1, 2]", "3.75 [1, 3]"))
    assert len(run_tutorials.check(page, write=False)) == 1


def test_a_block_that_prints_needs_its_output_shown(tutorials: Path) -> None:
    page = tutorials / "unshown.md"
    page.write_text(_PAGE.replace("total += value\n", "total += value\nprint('hidden')\n"))
    problems = run_tutorials.check(page, write=False)
    assert len(problems) == 1 and "shows no output" in problems[0] and "hidden" in problems[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("linewidth=4)\n", "linewidth=4)\naxes.remove()\n"), "nearly blank"),
        (
            ('figure.savefig("figures/line.png")', 'figure.savefig("figures/other.png")'),
            "did not write",
        ),
        (("![a line](figures/line.png)\n", ""), "does not show"),
    ],
)
def test_figure_problems_are_named(tutorials: Path, change: tuple[str, str], message: str) -> None:
    page = tutorials / "figure.md"
    page.write_text(_PAGE.replace(*change))
    problems = run_tutorials.check(page, write=False)
    assert problems and all(message in p or "figures/" in p for p in problems)
    assert any(message in p for p in problems)


def test_a_failing_block_names_itself(tutorials: Path) -> None:
    page = tutorials / "broken.md"
    page.write_text(_PAGE.replace("total = 0", "total = undefined_name"))
    with pytest.raises(RuntimeError, match=r"block 1 failed(.|\n)*NameError"):
        run_tutorials.check(page, write=False)


def test_another_driver_changes_only_the_boot_line() -> None:
    page = (
        "<!-- tutorial drivers: hf, vllm -->\n\n```python\nimport torch\n"
        f"{run_tutorials.HF_BOOT}print(model)\n```\n\n```\nshown\n```\n\n```python\nx = 1\n```\n"
    )
    assert run_tutorials.drivers_of(page) == ["hf", "vllm"]
    assert run_tutorials.drivers_of("# no comment") == ["hf"]
    blocks = run_tutorials.blocks_of(page)
    same, index = run_tutorials.with_boot(Path("page.md"), blocks, "hf")
    assert same == blocks and index == -1
    swapped, index = run_tutorials.with_boot(Path("page.md"), blocks, "vllm")
    assert index == 0 and swapped[1:] == blocks[1:]
    assert swapped[0].code == blocks[0].code.replace(
        run_tutorials.HF_BOOT, run_tutorials.BOOTS["vllm"]
    )
    with pytest.raises(RuntimeError, match="0 blocks boot with"):
        run_tutorials.with_boot(Path("page.md"), blocks[1:], "vllm")


def test_a_page_shown_on_vllm_swaps_its_own_boot_line_for_another_driver() -> None:
    page = (
        "<!-- tutorial drivers: vllm -->\n\n```python\n"
        f"{run_tutorials.BOOTS['vllm']}print(model)\n```\n\n```\nshown\n```\n"
    )
    blocks = run_tutorials.blocks_of(page)
    same, index = run_tutorials.with_boot(Path("page.md"), blocks, "vllm", "vllm")
    assert same == blocks and index == -1
    swapped, index = run_tutorials.with_boot(Path("page.md"), blocks, "hf", "vllm")
    assert index == 0 and run_tutorials.HF_BOOT in swapped[0].code
    assert run_tutorials.BOOTS["vllm"] not in swapped[0].code


def test_a_page_that_needs_a_missing_module_is_a_problem_not_a_run(tutorials: Path) -> None:
    page = tutorials / "needs.md"
    page.write_text("<!-- tutorial needs: json, no_such_module_here -->\n\n" + _PAGE)
    assert run_tutorials.missing_modules(page.read_text()) == ["no_such_module_here"]
    assert run_tutorials.missing_modules(_PAGE) == []
    problems = run_tutorials.check(page, write=False)
    assert len(problems) == 1 and "needs no_such_module_here" in problems[0]
    assert not (tutorials / "figures").exists(), (
        "the page ran although a module it needs is missing"
    )


def test_main_skips_a_page_needing_a_missing_module_and_says_why(
    tutorials: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tutorials / "needs.md").write_text("<!-- tutorial needs: no_such_module_here -->\n\n" + _PAGE)
    assert run_tutorials.main([]) == 0
    assert "needs.md: skipped (it needs no_such_module_here" in capsys.readouterr().out
    assert run_tutorials.main(["needs"]) == 1


_TRAINED = """# A trained page

<!-- tutorial recorded on: Chip A -->

<!-- tutorial output varies by processor -->

```python
print(f"feature {7:4d} fires on {' dog'!r} at 13.2")
```

```
feature    7 fires on ' dog' at 13.2
```

```python
print("steps", 400)
```

```
steps 400
```
"""


def _recorded_elsewhere(page: str) -> str:
    """The page as if a run on another processor had shown other features and values."""
    return page.replace(
        "feature    7 fires on ' dog' at 13.2", 'feature 2040 fires on " cat\'s" at 9.75'
    )


def test_a_marked_block_keeps_only_its_form_on_another_processor(
    tutorials: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tutorials / "trained.md"
    page.write_text(_recorded_elsewhere(_TRAINED))
    assert run_tutorials.varying_blocks(page.read_text()) == {0}
    monkeypatch.setattr(run_tutorials, "processor", lambda: "Chip B")
    assert run_tutorials.check(page, write=False) == []
    assert (
        "1 blocks checked by form only: recorded on Chip A, run on Chip B"
        in capsys.readouterr().out
    )
    # The form still counts: another word, and an unmarked block's numbers, are stale anywhere.
    page.write_text(_recorded_elsewhere(_TRAINED).replace('fires on "', 'dies on "'))
    assert len(run_tutorials.check(page, write=False)) == 1
    page.write_text(_recorded_elsewhere(_TRAINED).replace("steps 400", "steps 401"))
    problems = run_tutorials.check(page, write=False)
    assert len(problems) == 1 and "+steps 400" in problems[0]


def test_a_marked_block_is_checked_exactly_where_it_was_recorded(
    tutorials: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = tutorials / "trained.md"
    page.write_text(_recorded_elsewhere(_TRAINED))
    monkeypatch.setattr(run_tutorials, "processor", lambda: "Chip A")
    problems = run_tutorials.check(page, write=False)
    assert len(problems) == 1 and "+feature    7 fires on ' dog' at 13.2" in problems[0]


def test_write_records_the_page_on_this_processor(
    tutorials: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = tutorials / "trained.md"
    page.write_text(_recorded_elsewhere(_TRAINED))
    monkeypatch.setattr(run_tutorials, "processor", lambda: "Chip B")
    assert run_tutorials.check(page, write=True) == []
    assert page.read_text() == _TRAINED.replace("Chip A", "Chip B")
    # Without a recorded line, a page with marked blocks is a problem, and --write adds the line.
    unrecorded = _recorded_elsewhere(_TRAINED).replace(
        "<!-- tutorial recorded on: Chip A -->\n\n", ""
    )
    page.write_text(unrecorded)
    problems = run_tutorials.check(page, write=False)
    assert any("does not say where it was recorded" in p for p in problems)
    run_tutorials.check(page, write=True)
    assert "<!-- tutorial recorded on: Chip B -->" in page.read_text()
    assert run_tutorials.check(page, write=False) == []


def test_processor_names_the_model_family_and_vector_width() -> None:
    name = run_tutorials.processor()
    assert name and name != "unknown"
    if Path("/proc/cpuinfo").exists():
        assert " family " in name and name.rsplit(", ", 1)[1] in {"avx512", "avx2", "no avx2"}
