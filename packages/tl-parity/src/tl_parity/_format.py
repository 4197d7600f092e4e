"""Terminal table and Markdown report of a ``ParityReport``."""

from __future__ import annotations

from tl_parity._types import HookComparison, ParityReport

__all__ = ["format_markdown", "format_table"]

_HEAD = ("hook", "shape", "dtype", "max abs diff", "rel diff", "tolerance", "status")


def _num(x: float) -> str:
    return "-" if x != x else f"{x:.3g}"


def _cells(row: HookComparison) -> list[str]:
    return [
        row.hook,
        "x".join(map(str, row.shape)) or "-",
        row.dtype or "-",
        _num(row.max_abs),
        _num(row.max_rel),
        f"{row.atol:.2g}+{row.rtol:.2g}*|ref|",
        row.status,
    ]


def _rows(report: ParityReport) -> list[HookComparison]:
    return [*report.hooks, *([report.logits] if report.logits is not None else [])]


def _summary(report: ParityReport) -> str:
    rows = _rows(report)
    n_pass = sum(r.status == "PASS" for r in rows)
    verdict = "PASS" if report.passed else "FAIL"
    agree = "-" if report.argmax_agreement is None else f"{report.argmax_agreement:.1%}"
    return (
        f"{verdict}: {report.candidate} vs {report.reference} on {report.model} ({report.dtype}): "
        f"{n_pass}/{len(rows)} rows pass, argmax agreement {agree}, "
        f"{len(report.non_fireable)} hooks declared non-fireable"
    )


def format_table(report: ParityReport, *, show_non_fireable: bool = False) -> str:
    """A fixed-width table for the terminal: one line per hook, then the logits and a summary."""
    lines = []
    if report.error:
        lines.append(f"ERROR: {report.error}")
    rows = _rows(report)
    if rows:
        cells = [_cells(r) for r in rows]
        diag = any(r.diagnostic for r in rows)
        head = [*_HEAD, "diagnostic"] if diag else list(_HEAD)
        widths = [max(len(head[i]), *(len(c[i]) for c in cells)) for i in range(len(_HEAD))]
        fmt = "  ".join(f"{{:{w}}}" for w in widths)
        lines.append((fmt.format(*head[: len(_HEAD)]) + ("  diagnostic" if diag else "")).rstrip())
        for row, c in zip(rows, cells, strict=False):
            lines.append(
                (fmt.format(*c) + (f"  {row.diagnostic}" if row.diagnostic else "")).rstrip()
            )
    if show_non_fireable and report.non_fireable:
        lines.append("non-fireable:")
        lines.extend(f"  {k}: {v}" for k, v in sorted(report.non_fireable.items()))
    lines.append(_summary(report))
    return "\n".join(lines)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_markdown(report: ParityReport) -> str:
    """A Markdown report: summary, the hook table (with diagnostics) and the non-fireable hooks."""
    out = [
        f"# Parity: `{report.candidate}` vs `{report.reference}`",
        "",
        f"- model: `{report.model}`",
        f"- dtype: `{report.dtype}`",
        f"- schema version: {report.schema_version}",
        "",
        f"**{_summary(report)}**",
        "",
    ]
    if report.error:
        out += [f"> ERROR: {_md_escape(report.error)}", ""]
    rows = _rows(report)
    if rows:
        out.append("| " + " | ".join([*_HEAD, "diagnostic"]) + " |")
        out.append("|" + "---|" * (len(_HEAD) + 1))
        for row in rows:
            cells = [f"`{c}`" if i == 0 else c for i, c in enumerate(_cells(row))]
            out.append(
                "| "
                + " | ".join([*map(_md_escape, cells), _md_escape(row.diagnostic or "")])
                + " |"
            )
        out.append("")
    if report.non_fireable:
        out += ["## Declared non-fireable", "", "| hook | reason |", "|---|---|"]
        out += [f"| `{k}` | {_md_escape(v)} |" for k, v in sorted(report.non_fireable.items())]
        out.append("")
    return "\n".join(out)
