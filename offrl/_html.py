"""Shared pieces of offrl's self-contained HTML pages (the sweep report and the OPE report).

One stylesheet, inlined: a centred column at most 1100 px wide, tables that
fill it and wrap their text (so nothing scrolls sideways on a laptop screen),
figures that shrink to the column, captions under tables and figures, and a
summary box at the top.  Plots are base64 PNGs: the pages fetch nothing.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any, Iterable, Sequence

STYLE = """*{box-sizing:border-box}
body{margin:0;color:#1d1d1f;background:#fff;font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
main{max-width:1100px;margin:0 auto;padding:20px 28px 40px}
h1{font-size:1.65em;margin:.3em 0 .5em;font-weight:650}
h2{font-size:1.25em;margin:1.7em 0 .5em;padding-bottom:.2em;border-bottom:1px solid #ddd;font-weight:620}
h3{font-size:1.05em;margin:1.2em 0 .3em;font-weight:620}
p,li{max-width:80ch}
.summary{background:#f4f7fd;border:1px solid #c8d6f0;border-radius:6px;padding:6px 20px 10px;margin:.8em 0 1.2em}
.summary h2{border:0;margin:.5em 0 .2em;padding:0}
.summary li{margin:.3em 0}
table{border-collapse:collapse;width:100%;margin:.5em 0 1.3em;font-size:14px}
th,td{border:1px solid #d4d4d4;padding:4px 8px;vertical-align:top;text-align:left;overflow-wrap:break-word}
thead th{background:#f0f0f0;font-weight:620}
tbody th{background:#fafafa;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.ci{color:#5a5a5a;font-size:.88em}
.sub{display:block;color:#5a5a5a;font-size:.85em;font-weight:400}
caption{caption-side:bottom;text-align:left;font-size:13px;color:#4a4a4a;padding:5px 2px 0}
figure{margin:1em 0 1.5em}
figure img{display:block;max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:13px;color:#4a4a4a;margin-top:5px;max-width:100ch}
details{margin:1em 0;border:1px solid #e2e2e2;border-radius:5px;padding:4px 12px}
details>summary{cursor:pointer;font-weight:600;padding:4px 0}
table.raw{table-layout:fixed;font-size:11.5px}
table.raw td,table.raw th{padding:2px 4px;overflow-wrap:anywhere}
.good{color:#17692b;font-weight:600}.care{color:#955f00;font-weight:600}.bad{color:#a3191f;font-weight:600}
ul.reasons{margin:.2em 0 1em}ul.reasons li{margin:.25em 0}p.family{margin:1em 0 .2em}
.dim{color:#8a8a8a}.failed{color:#a3191f}
ul.settings{columns:2;column-gap:2em;padding-left:1.2em}
code{font-size:.92em;background:#f3f3f3;padding:0 3px;border-radius:3px}"""


def esc(value: Any) -> str:
    """HTML-escape anything, as text."""
    return html.escape(str(value))


def fmt(value: Any, digits: int = 4) -> str:
    """A number for a reader: about `digits` significant digits, at most one decimal from 100 up,
    thousands separators; infinities as ±∞ and NaN as 'n/a'."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(v):
        return "n/a"
    if math.isinf(v):
        return "∞" if v > 0 else "-∞"
    a = abs(v)
    if a >= 1000:
        text = f"{v:,.0f}"
    elif a >= 100:
        text = f"{v:.1f}"
    elif a >= 1 or a == 0:
        text = f"{v:.{max(digits - 2, 1)}f}".rstrip("0").rstrip(".") if a else "0"
    else:
        text = f"{v:.{max(digits - 1, 1)}g}"
    return "0" if text in ("-0", "-0.0") else text


def _triple(value: float, low: float, high: float) -> tuple[str, str, str]:
    """The three numbers with one number of decimals, set by the largest finite magnitude among them."""
    finite = [abs(float(v)) for v in (value, low, high) if math.isfinite(float(v))]
    top = max(finite, default=0.0)
    decimals = 0 if top >= 1000 else 1 if top >= 100 else 2 if top >= 1 else 3

    def one(v: float) -> str:
        v = float(v)
        if not math.isfinite(v) or top == 0 or top < 0.01:
            return fmt(v)
        text = f"{v:,.{decimals}f}"
        return text[1:] if text.startswith("-") and float(text.replace(",", "")) == 0 else text

    return one(value), one(low), one(high)


def interval_text(value: float, low: float, high: float) -> str:
    """'value [low, high]' as plain text, the three with the same decimals."""
    v, lo, hi = _triple(value, low, high)
    return f"{v} [{lo}, {hi}]"


def interval_cell(value: float, low: float, high: float) -> str:
    """'value [low, high]' as HTML, the interval in a lighter type (the cell's text is `interval_text`)."""
    v, lo, hi = _triple(value, low, high)
    return f"{esc(v)} <span class='ci'>[{esc(lo)}, {esc(hi)}]</span>"


def table(header: Sequence[str], rows: Iterable[Sequence[str]], caption: str = "", row_header: bool = True,
          numeric: Sequence[bool] | None = None, css_class: str = "") -> str:
    """A table from cells that are already HTML; the first cell of each row is a row header when `row_header`.

    `numeric[j]` right-aligns column j.
    """
    head = "".join(f"<th scope='col'>{h}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for j, cell in enumerate(row):
            if j == 0 and row_header:
                cells.append(f"<th scope='row'>{cell}</th>")
            else:
                cls = " class='num'" if numeric is not None and j < len(numeric) and numeric[j] else ""
                cells.append(f"<td{cls}>{cell}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    cap = f"<caption>{caption}</caption>" if caption else ""
    cls = f" class='{css_class}'" if css_class else ""
    return f"<table{cls}>{cap}<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def raw_table(frame: Any, float_digits: int = 4) -> str:
    """A DataFrame as a compact fixed-layout table (for the collapsed raw numbers)."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return esc(fmt(v, float_digits))
        return esc("" if v is None else v)

    header = [esc(c) for c in frame.columns]
    rows = [[cell(v) for v in row] for row in frame.itertuples(index=False, name=None)]
    return table(header, rows, row_header=False, css_class="raw")


def details(summary: str, inner: str) -> str:
    """A collapsed block: `summary` (HTML) is the line shown, `inner` (HTML) opens on a click."""
    return f"<details><summary>{summary}</summary>{inner}</details>"


def png_base64(fig: Any, dpi: int = 110) -> str:
    """A matplotlib figure as base64 PNG (the figure is closed)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def figure(fig: Any, alt: str, caption: str, dpi: int = 110) -> str:
    """A matplotlib figure as an inline <figure> with its caption (HTML); the figure is closed."""
    return (f"<figure><img alt='{esc(alt)}' src='data:image/png;base64,{png_base64(fig, dpi)}'>"
            f"<figcaption>{caption}</figcaption></figure>")


def summary_box(items: Sequence[str], title: str = "Summary") -> str:
    """The box at the top of a page: a heading and one paragraph per item (HTML)."""
    body = "".join(f"<p>{item}</p>" for item in items)
    return f"<section class='summary' id='summary'><h2>{esc(title)}</h2>{body}</section>"


def page(title: str, body: Sequence[str]) -> str:
    """A whole self-contained page: inline style, a responsive viewport, the body in one centred column."""
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{esc(title)}</title><style>{STYLE}</style></head><body><main>"
            f"<h1>{esc(title)}</h1>" + "\n".join(body) + "</main></body></html>")


def join_words(words: Sequence[str], last: str = "and") -> str:
    """'a', 'a and b', 'a, b and c'."""
    words = list(words)
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + f" {last} " + words[-1]
