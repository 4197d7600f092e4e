"""Every docs page the packages' messages and docstrings cite exists where cited (``nox -s docs``).

An error that says "see docs/adding-a-family.md" is only help if that page is in ``docs/``,
the site's source; a path cited from the repository root (``packages/.../docs/x.md``) must
exist there.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: A cited page: ``docs/NAME.md`` (an ``#anchor`` may follow), or a repository path ending so.
_CITED = re.compile(r"(?P<path>(?:[\w.-]+/)*docs/[\w/-]+\.md)")


def cited_pages(root: Path = ROOT) -> dict[str, list[str]]:
    """Each docs path cited in the packages' sources under ``root``, with where (``file:line``)."""
    found: dict[str, list[str]] = {}
    for source in sorted((root / "packages").glob("*/src/**/*.py")):
        for number, line in enumerate(source.read_text().splitlines(), 1):
            for match in _CITED.finditer(line):
                found.setdefault(match["path"], []).append(f"{source.relative_to(root)}:{number}")
    return found


def missing_pages(root: Path = ROOT) -> dict[str, list[str]]:
    """The cited pages that do not exist under ``root``, with where they are cited."""
    return {path: where for path, where in cited_pages(root).items() if not (root / path).is_file()}


def test_the_sources_cite_docs_pages() -> None:
    # The check below must have something to check: the hf driver's errors cite the guide.
    assert "docs/adding-a-family.md" in cited_pages()


def test_every_cited_docs_page_exists() -> None:
    missing = missing_pages()
    assert not missing, "\n".join(
        f"{path} (cited at {', '.join(w)})" for path, w in missing.items()
    )


def test_a_page_cited_but_missing_is_named_with_where(tmp_path: Path) -> None:
    module = tmp_path / "packages" / "pkg" / "src" / "pkg" / "errors.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        'GUIDE = "see docs/present.md"\n'
        'raise ValueError(f"describe it with an adapter (docs/absent.md#rows).")\n'
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "present.md").write_text("# here\n")
    assert missing_pages(tmp_path) == {"docs/absent.md": ["packages/pkg/src/pkg/errors.py:2"]}
