"""mkdocs hooks: put the package READMEs and guides on the site, and keep their links working.

The repository is read on GitHub as well as on the site, so the Markdown files keep their
repository-relative links (``docs/index.md`` links ``../packages/tl-parity/README.md``).
The site holds ``docs/`` at its root and every file of ``EXTRA_PAGES`` at its repository
path (``packages/tl-parity/README.md``, served as ``packages/tl-parity/``). A relative link
from any page to a file the site holds is rewritten to that file's place on the site; any
other relative link is left alone, so mkdocs' strict link validation still reports it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: Files outside docs/ that the site shows, as globs relative to the repository root.
EXTRA_PAGES = ("packages/*/README.md", "packages/*/docs/*.md", "benchmarks/README.md")

_LINK = re.compile(r"\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?(?P<title>\s+\"[^\"]*\")?\)")
_NOT_A_FILE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|/)", re.IGNORECASE)


def _site_path(real: Path) -> str:
    """Where a repository file sits on the site (relative to the site's root)."""
    if real.is_relative_to(DOCS):
        return real.relative_to(DOCS).as_posix()
    return real.relative_to(ROOT).as_posix()


def on_files(files: Files, config: Any) -> Files:
    """Add the pages of ``EXTRA_PAGES`` at their repository paths."""
    for pattern in EXTRA_PAGES:
        for path in sorted(ROOT.glob(pattern)):
            files.append(
                File(
                    path.relative_to(ROOT).as_posix(),
                    src_dir=str(ROOT),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Rewrite relative links to files the site holds to their site paths."""
    real_page = Path(page.file.abs_src_path)
    site_dir = Path(page.file.src_uri).parent

    def rewrite(match: re.Match[str]) -> str:
        target = match.group("target")
        if _NOT_A_FILE.match(target):
            return match.group(0)
        real = (real_page.parent / target).resolve()
        if not real.is_relative_to(ROOT) or files.get_file_from_path(_site_path(real)) is None:
            return match.group(0)
        moved = os.path.relpath(_site_path(real), site_dir.as_posix())
        return f"]({moved}{match.group('anchor') or ''}{match.group('title') or ''})"

    return _LINK.sub(rewrite, markdown)
