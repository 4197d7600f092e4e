"""The HTML report: self-contained markup, and a real headless browser draws the plot.

The browser test needs a Chromium binary (Debian/Ubuntu: ``apt-get install -y chromium``,
about two minutes); without one it is skipped with that line. It renders a report from a
real comparison (hf float32 against hf float64 on a tiny 4-layer GPT-2), screenshots the
page and decodes the PNG here (no Pillow needed).
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from tl_parity._html import PALETTE, render_html, render_svg_plot
from tl_parity._types import HookComparison, ParityReport

_KINDS = ("hook_in", "attn.hook_z", "attn.hook_pattern", "mlp.hook_post", "hook_out")
_CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_INSTALL = "apt-get install -y chromium"


def _hand_report(n_layers: int = 6) -> ParityReport:
    """Several layers and kinds, a FAIL with a diagnostic, a zero difference, odd names."""
    hooks = [
        HookComparison("embed.hook_out", (2, 5, 64), "float32", 0.0, 0.0, 2e-2, 2e-2, "PASS",
                       kind="embed.hook_out"),
    ]  # fmt: skip
    for layer in range(n_layers):
        for k, kind in enumerate(_KINDS):
            diff = 10.0 ** (-6 + 0.6 * layer + 0.5 * k) if (layer, k) != (0, 0) else 0.0
            status = "FAIL" if diff > 2e-2 else "PASS"
            hooks.append(
                HookComparison(
                    f"blocks.{layer}.{kind}", (2, 5, 64), "bfloat16", diff, diff / 3, 2e-2, 2e-2,
                    status, "scale differs by sqrt(d_model) <check>" if status == "FAIL" else None,
                    layer, kind,
                )
            )  # fmt: skip
    logits = HookComparison("logits", (2, 5, 100), "bfloat16", 0.5, 0.1, 2e-2, 2e-2, "FAIL",
                            kind="logits")  # fmt: skip
    return ParityReport(
        model="tiny <gpt2> & co", reference="hf", candidate="vllm", dtype="bfloat16",
        hooks=hooks, logits=logits, argmax_agreement=0.875,
        non_fireable={"blocks.0.attn.hook_result": "opt-in: boot with use_attn_result=True",
                      "pos_embed.hook_out": "rotary <model>"},
    )  # fmt: skip


def test_page_is_self_contained_and_complete() -> None:
    report = _hand_report()
    page = render_html(report)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # Nothing is fetched and nothing runs.
    assert not re.search(r"<script|<link|<img|<iframe|\bsrc=|\bhref=|url\(|@import|https?:", page)
    # Summary.
    for text in ("vllm", "hf", "bfloat16", "FAIL", "87.5%", "argmax agreement"):
        assert text in page
    assert "tiny &lt;gpt2&gt; &amp; co" in page and "<gpt2>" not in page
    # Every hook row, status coloured, with its diagnostic (escaped).
    assert page.count('class="status status-FAIL"') == sum(
        r.status == "FAIL" for r in [*report.hooks, report.logits]
    )
    assert page.count('class="status status-PASS"') == sum(r.status == "PASS" for r in report.hooks)
    assert "sqrt(d_model) &lt;check&gt;" in page
    for row in report.hooks:
        assert f">{row.hook}</td>" in page
    # Non-fireable hooks with reasons.
    assert "blocks.0.attn.hook_result" in page and "rotary &lt;model&gt;" in page
    # The plot: one polyline per kind, a tolerance line and a legend entry per kind.
    assert page.count('<polyline class="kind"') == len(_KINDS)
    assert page.count('class="tolerance"') == 1
    for kind in _KINDS:
        assert f'data-kind="{kind}"' in page and f">{kind}</text>" in page


def test_plot_geometry() -> None:
    svg = render_svg_plot(_hand_report(n_layers=3).hooks, width=900)
    assert svg.startswith("<svg") and 'width="900"' in svg
    lines = re.findall(r'<polyline class="kind" data-kind="([^"]+)" points="([^"]+)"', svg)
    assert [k for k, _ in lines] == list(_KINDS)
    for _, points in lines:
        xy = [tuple(map(float, p.split(","))) for p in points.split()]
        assert len(xy) == 3
        assert xy[0][0] < xy[1][0] < xy[2][0]  # x = layer, increasing
    # Larger differences sit higher (smaller y); the zero difference sits on the floor.
    (_, z_points) = lines[1]
    ys = [float(p.split(",")[1]) for p in z_points.split()]
    assert ys[0] > ys[1] > ys[2]
    assert "1e-" in svg and ">tolerance (atol)</text>" in svg
    assert "No per-layer hooks" in render_svg_plot([])


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, _CHROMIUM_NAMES) if p), None)


def _read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows of an 8-bit RGB/RGBA, non-interlaced PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
    bpp = 4 if colour == 6 else 3
    raw, stride = zlib.decompress(idat), width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        filt = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if filt == 1:
                line[i] = (line[i] + a) & 255
            elif filt == 2:
                line[i] = (line[i] + b) & 255
            elif filt == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif filt == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line
        rgb = bytes(line) if bpp == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3)
        rows.append(rgb)
    return width, height, rows


@pytest.fixture(scope="module")
def real_report(tmp_path_factory: pytest.TempPathFactory) -> ParityReport:
    """hf float32 against hf float64 on a tiny 4-layer GPT-2: small, real, non-zero diffs."""
    pytest.importorskip("tl_driver_hf")
    from tl_driver_hf.testing import write_tiny_checkpoint
    from tl_parity import run_parity

    path = write_tiny_checkpoint("gpt2", tmp_path_factory.mktemp("html") / "gpt2", n_layers=4)
    report = run_parity(path, candidate="hf", candidate_options={"dtype": "float64"}, quiet=True)
    assert report.error is None, report.error
    return report


@pytest.mark.slow
def test_headless_browser_draws_the_plot(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    chromium = _chromium()
    if chromium is None:
        pytest.skip(f"no Chromium binary on PATH; install it with: {_INSTALL}")
    real_report: ParityReport = request.getfixturevalue("real_report")  # only with a browser
    layered = [h for h in real_report.hooks if h.layer is not None]
    assert {h.layer for h in layered} == {0, 1, 2, 3}
    assert any(h.max_abs > 0 for h in layered), "fp32 vs fp64 should differ a little"
    page = tmp_path / "report.html"
    page.write_text(render_html(real_report), encoding="utf-8")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--screenshot={shot}", "--window-size=1200,900", page.as_uri()],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    width, height, rows = _read_png(shot)
    assert (width, height) == (1200, 900)
    # The page is not blank.
    non_white = sum(
        1 for row in rows for i in range(0, len(row), 3) if row[i : i + 3] != b"\xff" * 3
    )
    assert non_white > 0.03 * width * height, non_white
    # The plot sits below the summary: many colours there, and the kinds' line colours.
    region = [row[40 * 3 : 1100 * 3] for row in rows[300:850]]
    pixels = [r[i : i + 3] for r in region for i in range(0, len(r), 3)]
    colours = set(pixels)
    assert len(colours) > 50, len(colours)
    n_kinds = len({h.kind for h in layered})
    for hex_colour in PALETTE[: min(n_kinds, 5)]:
        rgb = bytes.fromhex(hex_colour[1:])
        assert pixels.count(rgb) > 20, f"line colour {hex_colour} not drawn"
