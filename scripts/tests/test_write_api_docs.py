"""The API reference check fails on what it promises to catch (run by ``nox -s docs``)."""

from __future__ import annotations

import importlib
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import write_api_docs

pytest.importorskip("griffe")


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write a throwaway package ``fakepkg`` and return a function that adds modules to it."""
    root = tmp_path / "fakepkg"
    root.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(files: dict[str, str]) -> dict[str, str]:
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(textwrap.dedent(text))
        for name in [m for m in sys.modules if m == "fakepkg" or m.startswith("fakepkg.")]:
            del sys.modules[name]
        importlib.invalidate_caches()
        return {"fake-dist": "fakepkg"}

    yield write
    for name in [m for m in sys.modules if m == "fakepkg" or m.startswith("fakepkg.")]:
        del sys.modules[name]


_DOCUMENTED = {
    "__init__.py": '''
        """A package."""
        from fakepkg._impl import Thing, make

        __all__ = ["Thing", "make", "LIMIT"]

        #: The largest thing.
        LIMIT = 3
    ''',
    "_impl.py": '''
        """Private."""


        class Thing:
            """A thing.

            Attributes:
                size: How big.
            """

            def __init__(self, colour: str) -> None:
                """Make one.

                Args:
                    colour: Its colour.
                """
                self.size = 1
                self.colour = colour

            def grow(self) -> None:
                """Grow."""


        def make() -> Thing:
            """Make a thing."""
            return Thing("red")
    ''',
    "sub/__init__.py": '''
        """A public subpackage that re-exports Thing."""
        from fakepkg._impl import Thing

        __all__ = ["Thing"]
    ''',
}


def test_a_fully_documented_package_passes_and_reexports_link_home(package) -> None:
    modules = write_api_docs.public_modules(package(_DOCUMENTED))
    assert [m.name for m in modules] == ["fakepkg", "fakepkg.sub"]
    assert write_api_docs.undocumented(modules) == []
    home = write_api_docs.homes(modules)
    assert home["fakepkg.sub.Thing"] == "fakepkg"
    sub_page = write_api_docs.render_page(modules[1], home)
    assert (
        "[`fakepkg.Thing`][fakepkg.Thing]" in sub_page and "::: fakepkg.sub.Thing" not in sub_page
    )
    top_page = write_api_docs.render_page(modules[0], home)
    assert all(f"::: fakepkg.{n}" in top_page for n in ("Thing", "make", "LIMIT"))


@pytest.mark.parametrize(
    ("old", "new", "missing"),
    [
        ('"""Make a thing."""', "pass", "fakepkg.make"),
        ('"""Grow."""', "pass", "fakepkg.Thing.grow"),
        ("size: How big.", "other: Not size.", "fakepkg.Thing.size"),
    ],
)
def test_a_missing_docstring_is_named(package, old: str, new: str, missing: str) -> None:
    files = dict(_DOCUMENTED, **{"_impl.py": _DOCUMENTED["_impl.py"].replace(old, new)})
    found = write_api_docs.undocumented(write_api_docs.public_modules(package(files)))
    assert [entry.split(" ")[0] for entry in found] == [missing]


def test_an_undocumented_constant_is_named(package) -> None:
    files = dict(
        _DOCUMENTED,
        **{"__init__.py": _DOCUMENTED["__init__.py"].replace("#: The largest thing.", "")},
    )
    found = write_api_docs.undocumented(write_api_docs.public_modules(package(files)))
    assert [entry.split(" ")[0] for entry in found] == ["fakepkg.LIMIT"]


def test_a_public_module_without_all_is_refused(package) -> None:
    files = dict(_DOCUMENTED, **{"sub/__init__.py": '"""No __all__."""\n'})
    with pytest.raises(SystemExit, match=r"'fakepkg\.sub' has no __all__"):
        write_api_docs.public_modules(package(files))


def test_a_missing_or_extra_page_fails_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "gone_module.md").write_text("# a module that no longer exists\n")
    monkeypatch.setattr(write_api_docs, "REFERENCE", reference)
    assert write_api_docs.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "stale or missing: " in err and "tl_core.md" in err
    assert "page of no public module: " in err and "gone_module.md" in err


def test_a_changed_public_api_fails_the_check_until_the_listing_is_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # The committed listing as it would be if a signature had changed in the code.
    reference = tmp_path / "reference"
    shutil.copytree(write_api_docs.REFERENCE, reference)
    listing = reference / write_api_docs.LISTING_NAME
    text = listing.read_text(encoding="utf-8")
    assert "def splice(bridge: Any, dictionary: SparseDictionary, *," in text
    listing.write_text(text.replace("def splice(bridge: Any,", "def splice(model: Any,"))
    mkdocs_yml = tmp_path / "mkdocs.yml"
    shutil.copy(write_api_docs.MKDOCS_YML, mkdocs_yml)
    monkeypatch.setattr(write_api_docs, "REFERENCE", reference)
    monkeypatch.setattr(write_api_docs, "MKDOCS_YML", mkdocs_yml)
    assert write_api_docs.main(["--check"]) == 1
    assert f"stale or missing: {listing}" in capsys.readouterr().err
    assert write_api_docs.main([]) == 0  # rewriting it from the code
    assert listing.read_text(encoding="utf-8") == text
    assert write_api_docs.main(["--check"]) == 0
