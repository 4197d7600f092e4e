"""tl-parity: prove, hook by hook, that a driver serves the tensor its name promises.

``run_parity`` runs the same token ids through a reference driver (default ``hf``) and a
candidate driver, each in its own process, and returns a ``ParityReport``; ``tl parity``
is the command line, and the ``parity`` pytest fixture asserts in one line. ``diagnose``
names the likely cause of a failing hook, ``alias_report`` lists every name of another
tool's naming generation with its status on a booted model, ``render_html`` writes a
self-contained report page.
"""

from __future__ import annotations

from tl_parity._aliases import GENERATIONS, AliasReport, AliasRow, alias_report, alias_reports
from tl_parity._blocks import LayerRangeError
from tl_parity._diagnose import diagnose
from tl_parity._format import format_markdown, format_table
from tl_parity._html import render_html
from tl_parity._run import DEFAULT_PROMPTS, run_parity, run_parity_many
from tl_parity._tolerance import Band, band_for, engine_of
from tl_parity._types import SCHEMA_VERSION, HookComparison, ParityReport
from tl_parity._version import __version__

__all__ = [
    "DEFAULT_PROMPTS",
    "GENERATIONS",
    "AliasReport",
    "AliasRow",
    "alias_report",
    "alias_reports",
    "diagnose",
    "render_html",
    "SCHEMA_VERSION",
    "Band",
    "HookComparison",
    "LayerRangeError",
    "ParityReport",
    "__version__",
    "band_for",
    "engine_of",
    "format_markdown",
    "format_table",
    "run_parity",
    "run_parity_many",
]
