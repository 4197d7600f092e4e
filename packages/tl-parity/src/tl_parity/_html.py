"""A self-contained HTML page for a ``ParityReport``, with a per-layer plot drawn as SVG.

The page loads nothing: styles are inline, the plot is an inline ``<svg>`` built here (no
matplotlib, no JavaScript), so it can be attached to a CI run or mailed as one file.
The Markdown form of the same report is ``tl_parity.format_markdown``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from tl_parity._types import HookComparison, ParityReport

__all__ = ["PALETTE", "render_html", "render_svg_plot"]

#: Line colours of the plot, one per hook kind in order of first appearance (cycled, with
#: a dash pattern per cycle, when a model has more kinds than colours).
PALETTE: tuple[str, ...] = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39",
)  # fmt: skip
_DASHES = ("", "6 3", "2 2", "8 3 2 3")
#: Differences at or below this are drawn on the floor of the plot (log10 of 0 is -inf).
_FLOOR = 1e-12

_STATUS_COLOURS = {
    "PASS": ("#d7f0d7", "#1b5e20"),
    "FAIL": ("#f8d3d3", "#b71c1c"),
    "MISSING": ("#fde7c4", "#8a5300"),
    "ERROR": ("#ead7f2", "#5b2a86"),
}

_CSS = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px;
       color: #222; background: #fff; }
h1 { font-size: 22px; margin: 0 0 8px; }
h2 { font-size: 17px; margin: 24px 0 8px; }
.verdict { display: inline-block; padding: 2px 10px; border-radius: 4px; font-weight: 700; }
.summary { display: grid; grid-template-columns: max-content auto; gap: 2px 16px;
           margin: 8px 0; }
.summary dt { color: #555; } .summary dd { margin: 0; font-family: ui-monospace, monospace; }
table { border-collapse: collapse; margin: 4px 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
td.num { text-align: right; font-family: ui-monospace, monospace; }
td.hook { font-family: ui-monospace, monospace; }
.error { border: 2px solid #b71c1c; background: #fdecec; padding: 8px; }
svg text { font: 12px system-ui, sans-serif; fill: #222; }
"""


def _num(x: float | None, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if x != x:
        return "nan"
    return format(x, spec)


def _status_cell(status: str) -> str:
    bg, fg = _STATUS_COLOURS.get(status, ("#eeeeee", "#222222"))
    return (
        f'<td class="status status-{escape(status)}" style="background:{bg};color:{fg};'
        f'font-weight:700">{escape(status)}</td>'
    )


def _rows(report: ParityReport) -> list[HookComparison]:
    return [*report.hooks, *([report.logits] if report.logits is not None else [])]


def _kind(row: HookComparison) -> str:
    if row.kind:
        return row.kind
    parts = row.hook.split(".", 2)
    return parts[2] if len(parts) == 3 and parts[0] == "blocks" else row.hook


def render_svg_plot(hooks: Sequence[HookComparison], *, width: int = 1100) -> str:
    """An inline SVG: max abs difference per layer, one polyline per hook kind.

    x is the block index, y is ``log10(max_abs)`` (differences of 0 sit on the floor,
    1e-12); a dashed line is the absolute tolerance (the smallest ``atol`` of each layer);
    ``FAIL`` points are ringed. Rows without a layer are left out.

    Args:
        hooks: The comparisons to plot (those with ``layer`` set are used).
        width: Width of the drawing in pixels.

    Returns:
        An ``<svg>`` element, or a ``<p>`` saying there is nothing to plot.
    """
    rows = [h for h in hooks if h.layer is not None and not math.isnan(h.max_abs)]
    if not rows:
        return '<p class="no-plot">No per-layer hooks to plot.</p>'
    kinds: list[str] = []
    for row in rows:
        if _kind(row) not in kinds:
            kinds.append(_kind(row))
    layers = sorted({int(h.layer) for h in rows if h.layer is not None})
    tol = {layer: min(h.atol for h in rows if h.layer == layer) for layer in layers}

    def y_of(value: float) -> float:
        return math.log10(min(max(value, _FLOOR), 1e300))

    ys = [y_of(h.max_abs) for h in rows] + [y_of(t) for t in tol.values() if t > 0]
    y_lo, y_hi = math.floor(min(ys)) - 1, math.ceil(max(ys)) + 1
    legend_w, left, top, right, bottom = 260, 64, 28, 16, 48
    row_h = 18
    height = max(380, top + bottom + row_h * (len(kinds) + 2))
    plot_w = width - left - right - legend_w
    plot_h = height - top - bottom
    lo_x, hi_x = layers[0], layers[-1]

    def px(layer: float) -> float:
        if hi_x == lo_x:
            return left + plot_w / 2
        return left + (layer - lo_x) / (hi_x - lo_x) * plot_w

    def py(value: float) -> float:
        return top + (y_hi - y_of(value)) / (y_hi - y_lo) * plot_h

    out = [
        f'<svg id="layer-plot" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="max abs difference per layer and hook kind">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fafafa" '
        f'stroke="#888"/>',
    ]
    step = max(1, (y_hi - y_lo) // 8)
    for exp in range(y_lo, y_hi + 1, step):
        yy = top + (y_hi - exp) / (y_hi - y_lo) * plot_h
        out.append(
            f'<line x1="{left}" y1="{yy:.1f}" x2="{left + plot_w}" y2="{yy:.1f}" stroke="#e2e2e2"/>'
        )
        out.append(f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end">1e{exp}</text>')
    x_step = max(1, len(layers) // 16)
    for layer in layers[::x_step]:
        xx = px(layer)
        out.append(
            f'<line x1="{xx:.1f}" y1="{top + plot_h}" x2="{xx:.1f}" y2="{top + plot_h + 4}" '
            f'stroke="#888"/>'
        )
        out.append(
            f'<text x="{xx:.1f}" y="{top + plot_h + 18}" text-anchor="middle">{layer}</text>'
        )
    out.append(
        f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle">layer</text>'
    )
    out.append(
        f'<text x="14" y="{top + plot_h / 2:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 14 {top + plot_h / 2:.1f})">max abs diff (log10)</text>'
    )
    tol_points = " ".join(f"{px(layer):.1f},{py(t):.1f}" for layer, t in tol.items() if t > 0)
    if tol_points:
        if len(tol) == 1:  # one layer: draw the band across the plot
            t = next(iter(tol.values()))
            tol_points = f"{left},{py(t):.1f} {left + plot_w},{py(t):.1f}"
        out.append(
            f'<polyline class="tolerance" points="{tol_points}" fill="none" stroke="#000000" '
            f'stroke-width="1.5" stroke-dasharray="7 4"/>'
        )
    for n, kind in enumerate(kinds):
        colour = PALETTE[n % len(PALETTE)]
        dash = _DASHES[(n // len(PALETTE)) % len(_DASHES)]
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        pts = sorted((int(h.layer), h) for h in rows if _kind(h) == kind and h.layer is not None)
        coords = " ".join(f"{px(layer):.1f},{py(h.max_abs):.1f}" for layer, h in pts)
        out.append(
            f'<polyline class="kind" data-kind="{escape(kind)}" points="{coords}" fill="none" '
            f'stroke="{colour}" stroke-width="2.5"{dash_attr}/>'
        )
        for layer, h in pts:
            ring = ' stroke="#b71c1c" stroke-width="2.5"' if h.status == "FAIL" else ""
            radius = 5 if h.status == "FAIL" else 3.5
            out.append(
                f'<circle cx="{px(layer):.1f}" cy="{py(h.max_abs):.1f}" r="{radius}" '
                f'fill="{colour}"{ring}><title>{escape(h.hook)}: {_num(h.max_abs)} '
                f"({escape(h.status)})</title></circle>"
            )
    lx = left + plot_w + 16
    out.append(f'<g class="legend"><text x="{lx}" y="{top + 4}" font-weight="700">hook kind</text>')
    for n, kind in enumerate(kinds):
        yy = top + row_h * (n + 1) + 4
        colour = PALETTE[n % len(PALETTE)]
        dash = _DASHES[(n // len(PALETTE)) % len(_DASHES)]
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<line x1="{lx}" y1="{yy - 4}" x2="{lx + 24}" y2="{yy - 4}" stroke="{colour}" '
            f'stroke-width="3"{dash_attr}/><text x="{lx + 30}" y="{yy}">{escape(kind)}</text>'
        )
    yy = top + row_h * (len(kinds) + 1) + 4
    out.append(
        f'<line x1="{lx}" y1="{yy - 4}" x2="{lx + 24}" y2="{yy - 4}" stroke="#000" '
        f'stroke-width="1.5" stroke-dasharray="7 4"/><text x="{lx + 30}" y="{yy}">'
        f"tolerance (atol)</text></g>"
    )
    out.append("</svg>")
    return "\n".join(out)


def render_html(report: ParityReport) -> str:
    """The report as one self-contained HTML page.

    The page holds the summary (model, drivers, dtype, verdict, counts per status, logits
    row and argmax agreement), the per-layer plot of the largest absolute difference per
    hook kind (inline SVG with the tolerance line and a legend), the table of every hook
    (status coloured, with its diagnostic) and the hooks the candidate declares
    non-fireable, with their reasons. It references no external resource and runs no
    script.

    Args:
        report: A finished parity report (``run_parity`` or ``ParityReport.from_dict``).

    Returns:
        The HTML text (UTF-8, ``<!DOCTYPE html>``).
    """
    rows = _rows(report)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    verdict = "PASS" if report.passed else "FAIL"
    bg, fg = _STATUS_COLOURS[verdict]
    title = f"Parity: {report.candidate} vs {report.reference} on {report.model}"
    logits = report.logits
    logits_text = (
        "not compared (no sequence logits)"
        if logits is None
        else f"{logits.status}: max abs diff {_num(logits.max_abs)} "
        f"(atol {_num(logits.atol, '.2g')}, rtol {_num(logits.rtol, '.2g')})"
    )
    agree = "-" if report.argmax_agreement is None else f"{report.argmax_agreement:.1%}"
    summary = [
        ("model", report.model),
        ("reference driver", report.reference),
        ("candidate driver", report.candidate),
        ("dtype", report.dtype),
        ("rows", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"),
        ("logits", logits_text),
        ("argmax agreement", agree),
        ("declared non-fireable", str(len(report.non_fireable))),
        ("schema version", str(report.schema_version)),
    ]
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f'<h1>{escape(title)} <span class="verdict" style="background:{bg};color:{fg}">'
        f"{verdict}</span></h1>",
    ]
    if report.error:
        out.append(f'<div class="error"><b>ERROR:</b> {escape(report.error)}</div>')
    out.append('<dl class="summary">')
    out += [f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in summary]
    out.append("</dl>")
    out.append("<h2>Max abs difference per layer</h2>")
    out.append(render_svg_plot(report.hooks))
    out.append(f"<h2>Hooks ({len(rows)})</h2>")
    if rows:
        out.append(
            "<table><thead><tr><th>hook</th><th>shape</th><th>dtype</th><th>max abs diff</th>"
            "<th>max rel diff</th><th>atol</th><th>rtol</th><th>status</th>"
            "<th>diagnostic</th></tr></thead><tbody>"
        )
        for row in rows:
            out.append(
                f'<tr><td class="hook">{escape(row.hook)}</td>'
                f"<td>{escape('x'.join(map(str, row.shape)) or '-')}</td>"
                f"<td>{escape(row.dtype or '-')}</td>"
                f'<td class="num">{_num(row.max_abs)}</td><td class="num">{_num(row.max_rel)}</td>'
                f'<td class="num">{_num(row.atol, ".2g")}</td>'
                f'<td class="num">{_num(row.rtol, ".2g")}</td>'
                f"{_status_cell(row.status)}<td>{escape(row.diagnostic or '')}</td></tr>"
            )
        out.append("</tbody></table>")
    else:
        out.append("<p>No rows.</p>")
    out.append(f"<h2>Declared non-fireable ({len(report.non_fireable)})</h2>")
    if report.non_fireable:
        out.append("<table><thead><tr><th>hook</th><th>reason</th></tr></thead><tbody>")
        out += [
            f'<tr><td class="hook">{escape(k)}</td><td>{escape(v)}</td></tr>'
            for k, v in sorted(report.non_fireable.items())
        ]
        out.append("</tbody></table>")
    else:
        out.append("<p>None.</p>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
