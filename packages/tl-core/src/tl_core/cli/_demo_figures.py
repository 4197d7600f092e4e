"""The figures of ``tl demo`` as PNG files next to a short HTML page that shows them."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

__all__ = ["FIGURES", "write"]

#: File name -> caption of every figure the demo writes.
FIGURES = {
    "logit_lens.png": "Logit lens: the top token (and its probability) read out after every block at every position.",
    "patching.png": "Activation patching: the clean residual stream at one layer and position, patched into the corrupted run.",
    "induction_heads.png": "Induction score of every head on repeated random tokens.",
    "attention_pattern.png": "Attention pattern of the top induction head on one repeated sequence.",
}


def write(results: Any, out: Path) -> str:
    """Draw the figures into ``out`` with an ``index.html``; returns the line to print.

    Without matplotlib nothing is written and the line says how to get it.
    """
    import importlib.util

    from tl_core.plots._figures import PLOTS_EXTRA

    if importlib.util.find_spec("matplotlib") is None:
        return f"no figures: matplotlib is not installed ({PLOTS_EXTRA}); the numbers above are complete"
    from tl_core.plots import plot_head_scores, plot_patching

    out.mkdir(parents=True, exist_ok=True)
    model = results.model
    layer, head = results.top_head
    n_layers = model.cfg.n_layers
    figures = {
        "logit_lens.png": results.lens_cache.plot_logit_lens(
            tokenizer=model.tokenizer,
            tokens=results.lens_tokens,
            title="Logit lens (top token per cell)",
        ),
        "patching.png": plot_patching(
            results.patching,
            [f"blocks.{i}.hook_in" for i in range(n_layers)],
            results.patch_tokens,
            value_label="share of the clean logit difference restored",
            title="Patching clean -> corrupted ('France' -> 'Italy')",
        ),
        "induction_heads.png": plot_head_scores(
            results.induction_scores, value_label="induction score", title="Induction heads"
        ),
        "attention_pattern.png": results.induction_cache.plot_pattern(
            layer,
            head,
            prompt=0,
            tokens=results.induction_tokens,
            title=f"blocks.{layer}.attn head {head} on repeated random tokens",
        ),
    }
    for name, figure in figures.items():
        figure.savefig(out / name, dpi=100)
    (out / "index.html").write_text(_page(results.summary))
    return f"wrote {', '.join(figures)} and index.html to {out}/"


def _page(summary: dict[str, str]) -> str:
    notes = {"logit_lens.png": summary["lens"], "patching.png": summary["patching"]}
    sections = "\n".join(
        f"<h2>{html.escape(caption)}</h2>\n"
        + (f"<p>{html.escape(notes[name])}</p>\n" if name in notes else "")
        + f'<img src="{name}" alt="{html.escape(caption)}">'
        for name, caption in FIGURES.items()
    )
    return (
        '<!doctype html>\n<html><head><meta charset="utf-8"><title>tl demo: SmolLM2-135M-Instruct</title>\n'
        "<style>body{font-family:sans-serif;max-width:72em;margin:auto}img{max-width:100%}</style>"
        "</head><body>\n<h1>tl demo on SmolLM2-135M-Instruct</h1>\n"
        f"{sections}\n</body></html>\n"
    )
