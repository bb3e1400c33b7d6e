r"""Tables of the paper artifact: CSV (exact), LaTeX (booktabs) and markdown, from lists of dicts.

>>> print(to_latex([{"d": 3, "path": "wire", "ler": 0.0123456}], caption="LER at p=1%", label="tab:ler"))
\begin{table}[ht]
\centering
\small
\begin{tabular}{rlr}
\toprule
d & path & ler \\
\midrule
3 & wire & 0.01235 \\
\bottomrule
\end{tabular}
\caption{LER at p=1\%}
\label{tab:ler}
\end{table}
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Iterable

__all__ = ["to_latex", "to_markdown", "write_csv"]


def _columns(rows: list[dict], columns: Iterable[str] | None) -> list[str]:
    if columns is not None:
        return list(columns)
    out: list[str] = []
    for r in rows:
        out.extend(k for k in r if k not in out)
    return out


def _py(v):
    """A NumPy scalar as the Python number it holds (so it prints as one)."""
    return v.item() if type(v).__module__ == "numpy" and hasattr(v, "item") else v


def _text(v, float_format: str) -> str:
    v = _py(v)
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "--" if math.isnan(v) else float_format.format(v)
    return str(v)


_TEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def _tex(s: str) -> str:
    return "".join(_TEX_ESCAPES.get(c, c) for c in s)


def _tex_cell(v, float_format: str) -> str:
    r"""A cell for LaTeX: integers with thin-space thousands (``20\,730``), floats to the format's
    significant digits written out in full below 10^9, and ``$m\times10^{e}$`` for the very small.

    >>> print(" ".join(_tex_cell(x, "{:.4g}") for x in (20733.1, 123456789, 0.001234, -9.19e-11, 3, True, "a_b")))
    20\,730 123\,456\,789 0.001234 $-9.19\times10^{-11}$ 3 yes a\_b
    """
    v = _py(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _tex(_text(v, float_format))
    if isinstance(v, int):
        return f"{v:,}".replace(",", r"\,")
    if not math.isfinite(v):
        return "--" if math.isnan(v) else (r"$\infty$" if v > 0 else r"$-\infty$")
    s = float_format.format(v)
    if "e" not in s:
        return s
    r = float(s)
    if 1e4 <= abs(r) < 1e9:
        return f"{round(r):,}".replace(",", r"\,")
    mant, exp = s.split("e")
    return rf"${mant}\times10^{{{int(exp)}}}$"


def _numeric(rows: list[dict], col: str) -> bool:
    vals = [_py(r.get(col)) for r in rows if r.get(col) is not None]
    return bool(vals) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)


def to_latex(rows: list[dict], *, columns: Iterable[str] | None = None, caption: str | None = None,
             label: str | None = None, float_format: str = "{:.4g}") -> str:
    """A booktabs ``table`` of ``rows`` (dicts); numeric columns right-aligned, text escaped."""
    cols = _columns(rows, columns)
    if not cols:
        raise ValueError("to_latex needs at least one column (rows are empty and no columns were given)")
    align = "".join("r" if _numeric(rows, c) else "l" for c in cols)
    lines = [r"\begin{table}[ht]", r"\centering", r"\small", rf"\begin{{tabular}}{{{align}}}", r"\toprule",
             " & ".join(_tex(c) for c in cols) + r" \\", r"\midrule"]
    lines += [" & ".join(_tex_cell(r.get(c), float_format) for c in cols) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    if caption:
        lines.append(rf"\caption{{{_tex(caption)}}}")
    if label:
        lines.append(rf"\label{{{label}}}")
    lines.append(r"\end{table}")
    return "\n".join(lines)


def to_markdown(rows: list[dict], *, columns: Iterable[str] | None = None, float_format: str = "{:.4g}") -> str:
    """A GitHub-flavoured markdown table of ``rows``.

    >>> print(to_markdown([{"transport": "shm", "p50_us": 0.74}, {"transport": "tcp", "p50_us": 61.0}]))
    | transport | p50_us |
    |---|---:|
    | shm | 0.74 |
    | tcp | 61 |
    """
    cols = _columns(rows, columns)
    head = "| " + " | ".join(cols) + " |"
    rule = "|" + "|".join("---:" if _numeric(rows, c) else "---" for c in cols) + "|"
    body = ["| " + " | ".join(_text(r.get(c), float_format).replace("|", "\\|") for c in cols) + " |"
            for r in rows]
    return "\n".join([head, rule, *body])


def write_csv(rows: list[dict], path, *, columns: Iterable[str] | None = None) -> Path:
    """Write ``rows`` as CSV (columns: the union of the rows' keys in first-seen order).
    Floats are written with ``repr``, so equal numbers give equal bytes."""
    cols = _columns(rows, columns)
    path = Path(path)
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(cols)
        for r in rows:
            vals = [_py(r.get(c)) for c in cols]
            w.writerow(["" if v is None else repr(v) if isinstance(v, float) else v for v in vals])
    return path
