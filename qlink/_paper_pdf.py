"""``paper.pdf`` from the built ``paper.md``, typeset by Typst (the ``typst`` package bundles its compiler).

:func:`markdown_to_typst` turns the markdown subset the paper uses — headings, paragraphs,
``*``/``-`` lists, ``**bold**``, ``*italic*``, `` `code` ``, links, images and pipe tables
(as :func:`qlink.paper.to_markdown` writes them) — into Typst markup; every other
character of the text is escaped, so a number or a name in a table can never turn into
markup. :func:`build_pdf` writes ``paper.typ`` beside ``paper.md`` and compiles it; the
figures are the PNGs of the same build, sized to fit the page.

>>> print(markdown_to_typst("## 3. Results\\n\\nThe *loop* costs **2 us** at p = 0.001 (`shm`).\\n"))
== 3. Results
<BLANKLINE>
The _loop_ costs *2 us* at p = 0.001 (`shm`).
>>> print(markdown_to_typst("| d | ler |\\n|---|---:|\\n| 3 | 0.012 |"))
#text(size: 7pt)[#table(columns: 2, align: (left, right), stroke: 0.4pt + luma(180), inset: 3pt,
  table.header([*d*], [*ler*]),
  [3], [0.012],
)]
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

__all__ = ["markdown_to_typst", "build_pdf", "PREAMBLE"]

PREAMBLE = """#set document(title: "{title}")
#set page(paper: "a4", margin: (x: 2cm, y: 2.2cm), numbering: "1")
#set text(size: 10pt)
#set par(justify: true)
#show heading: set block(above: 1.2em, below: 0.7em)
#show raw: set text(size: 8.5pt)
"""

_TEXT_WIDTH_CM = 17.0  # A4 minus the margins
_MAX_FIG_HEIGHT_CM = 19.0
_ESCAPE = re.compile(r"([\\#$*_`<>@\[\]~]|/(?=[/*])|-(?=-))")  # '//' and '/*' open comments, '--' a dash
_INLINE = re.compile(r"(`[^`]+`)|(\*\*(?=\S)(.+?)(?<=\S)\*\*)|(\*(?=[^\s*])(.+?)(?<=[^\s*])\*)"
                     r"|(\[([^\]]+)\]\(([^)\s]+)\))")
_IMAGE = re.compile(r"^!\[([^\]]*)\]\(([^)\s]+)\)\s*$")
_LIST = re.compile(r"^\s*[*-]\s+")


def _escape(text: str) -> str:
    return _ESCAPE.sub(r"\\\1", text)


def _escape_start(markup: str) -> str:
    """Escape what would start a heading, list or numbered item at the start of a block."""
    m = re.match(r"^(\d+)\.", markup)
    if m:
        return f"{m.group(1)}\\.{markup[m.end():]}"
    return "\\" + markup if markup[:1] in ("=", "+", "-") else markup


def _inline(text: str) -> str:
    """Markdown inline markup of ``text`` as Typst markup; everything else escaped."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(_escape(text[pos:m.start()]))
        if m.group(1):  # `code`: Typst raw text has the same syntax and reads nothing inside
            out.append(m.group(1))
        elif m.group(2):
            out.append(f"*{_inline(m.group(3))}*")
        elif m.group(4):
            out.append(f"_{_inline(m.group(5))}_")
        else:
            url = m.group(8).replace("\\", "\\\\").replace('"', '\\"')
            out.append(f'#link("{url}")[{_inline(m.group(7))}]')
        pos = m.end()
    out.append(_escape(text[pos:]))
    return "".join(out)


def _png_size(path: Path) -> tuple[int, int] | None:
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError:
        return None
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return struct.unpack(">II", head[16:24])


def _figure(alt: str, src: str, base: Path | None) -> str:
    path = src.replace("\\", "/").replace('"', "")
    size = _png_size(base / path) if base is not None else None
    if base is not None and not (base / path).is_file():
        return f"_(figure {_escape(path)} was not built in this run)_"
    fit = "width: 100%"
    if size and size[0] > 0 and _TEXT_WIDTH_CM * size[1] / size[0] > _MAX_FIG_HEIGHT_CM:
        fit = f"height: {_MAX_FIG_HEIGHT_CM}cm"
    return f'#figure(image("{path}", {fit}), caption: [{_inline(alt)}], supplement: none, numbering: none)'


def _cells(line: str) -> list[str]:
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", body)]


_SCI = re.compile(r"^(-?\d(?:\.\d+)?)e([+-]\d+)$")


def _cell(text: str) -> str:
    """A table cell; a number markdown wrote as ``1.016e+05`` is set as 101,600 (or m × 10^e when tiny or huge).

    >>> _cell("1.016e+05"), _cell("-9.19e-11"), _cell("0.5")
    ('101,600', '$-9.19 times 10^(-11)$', '0.5')
    """
    m = _SCI.match(text.strip())
    if not m:
        return _inline(text)
    v = float(text)
    if 1e4 <= abs(v) < 1e9:
        return f"{round(v):,}"
    return f"${m.group(1)} times 10^({int(m.group(2))})$"


def _table(lines: list[str]) -> str:
    head = _cells(lines[0])
    rule = _cells(lines[1]) if len(lines) > 1 and set(lines[1].replace("|", "").strip()) <= set("-: ") else None
    rows = [_cells(ln) for ln in lines[(2 if rule else 1):]]
    n = len(head)
    align = ["right" if rule and i < len(rule) and rule[i].endswith(":") else "left" for i in range(n)]
    cells = lambda r: ", ".join(f"[{_cell(c)}]" for c in (r + [""] * n)[:n])  # noqa: E731
    out = [f"#text(size: 7pt)[#table(columns: {n}, align: ({', '.join(align)}), stroke: 0.4pt + luma(180), "
           f"inset: 3pt,", f"  table.header({', '.join(f'[*{_inline(h)}*]' for h in head)}),"]
    out += [f"  {cells(r)}," for r in rows]
    out.append(")]")
    return "\n".join(out)


def markdown_to_typst(text: str, *, base: Path | None = None) -> str:
    """Typst markup for the markdown ``text`` (images resolved against ``base`` when given)."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    lines = text.splitlines()
    blocks: list[str] = []
    i = 0
    while i < len(lines):
        ln = lines[i]
        if not ln.strip():
            i += 1
            continue
        if ln.startswith("#"):
            level = len(ln) - len(ln.lstrip("#"))
            blocks.append("=" * level + " " + _inline(ln[level:].strip()))
            i += 1
        elif _IMAGE.match(ln.strip()):
            figs = []
            while i < len(lines) and _IMAGE.match(lines[i].strip()):
                m = _IMAGE.match(lines[i].strip())
                figs.append(_figure(m.group(1), m.group(2), base))
                i += 1
            blocks.append("\n".join(figs))
        elif ln.lstrip().startswith("|"):
            tab = []
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                tab.append(lines[i])
                i += 1
            blocks.append(_table(tab))
        elif _LIST.match(ln):
            items: list[str] = []
            while i < len(lines) and lines[i].strip():
                if _LIST.match(lines[i]):
                    items.append(_LIST.sub("", lines[i]).strip())
                else:
                    items[-1] += " " + lines[i].strip()
                i += 1
            blocks.append("\n".join(f"- {_escape_start(_inline(it))}" for it in items))
        else:
            para = []
            while (i < len(lines) and lines[i].strip() and not lines[i].startswith("#")
                   and not lines[i].lstrip().startswith("|") and not _IMAGE.match(lines[i].strip())
                   and not _LIST.match(lines[i])):
                para.append(lines[i].strip())
                i += 1
            blocks.append(_escape_start(_inline(" ".join(para))))
    return "\n\n".join(blocks)


def build_pdf(paper_md, pdf_path=None) -> Path:
    """Typeset ``paper_md`` (a built ``paper.md``) into ``pdf_path`` (default: ``paper.pdf`` beside it).

    Raises :class:`qlink.errors.MissingDependencyError` when the ``typst`` package is absent.
    """
    from .errors import missing

    try:
        import typst
    except ImportError:
        raise missing("typst", extra="paper", feature="paper.pdf") from None
    md = Path(paper_md)
    pdf = Path(pdf_path) if pdf_path is not None else md.with_suffix(".pdf")
    text = md.read_text()
    first = next((ln for ln in text.splitlines() if ln.startswith("# ")), "# qlink paper")
    title = first[2:].strip().replace("\\", "").replace('"', "'")
    body = markdown_to_typst(text, base=md.parent)
    typ = md.with_suffix(".typ")
    head, _, rest = body.partition("\n\n")
    if head.startswith("= "):  # the paper's title, set apart
        head = f"#align(center, text(size: 16pt, weight: \"bold\")[{head[2:]}])"
    typ.write_text(PREAMBLE.format(title=title) + "\n" + head + "\n\n" + rest + "\n")
    typst.compile(str(typ), output=str(pdf), root=str(md.parent))
    return pdf
