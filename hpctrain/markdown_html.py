"""A report as a list of blocks, rendered to Markdown and to standalone HTML.

One structure, two renderers: the two files can never say different things.
Blocks: ``("h1"|"h2"|"p", text)``, ``("table", headers, rows)``, ``("img", path, alt)``,
``("list", items)``. Text may hold ``**bold**`` and ``code`` spans (backticks).
An image's path is relative to the report's folder; ``to_html(..., embed_from=folder)``
puts each PNG into the page itself (a ``data:`` URI), so that the page is one file that
shows its plots anywhere, offline, mailed or copied away from its folder.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path


def to_markdown(blocks: list[tuple]) -> str:
    out = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2"):
            out.append(("# " if kind == "h1" else "## ") + b[1])
        elif kind == "p":
            out.append(b[1])
        elif kind == "list":
            out.append("\n".join(f"- {item}" for item in b[1]))
        elif kind == "table":
            headers, rows = b[1], b[2]
            lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines))
        elif kind == "img":
            out.append(f"![{b[2]}]({b[1]})")
        else:
            raise ValueError(f"unknown block {kind!r}")
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    t = html.escape(str(text))
    t = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", t)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", t)


STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
         "table{border-collapse:collapse;font-size:0.85em;margin:1em 0}"
         "td,th{border:1px solid #bbb;padding:3px 6px;text-align:right}"
         "th{background:#eee}td:first-child{text-align:left}img{max-width:100%}"
         "code{background:#f4f4f4}")


def _image_source(path: str, embed_from: Path | None) -> str:
    if embed_from is None:
        return html.escape(path)
    data = base64.b64encode((Path(embed_from) / path).read_bytes()).decode("ascii")
    return f"data:image/png;base64,{data}"


def to_html(blocks: list[tuple], title: str, embed_from: Path | None = None) -> str:
    """Standalone HTML; with ``embed_from`` (the folder image paths are relative to) each
    image is embedded in the page instead of linked."""
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
           f"</title><style>{STYLE}</style></head><body>"]
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2"):
            out.append(f"<{kind}>{_inline(b[1])}</{kind}>")
        elif kind == "p":
            out.append(f"<p>{_inline(b[1])}</p>")
        elif kind == "list":
            out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{_inline(h)}</th>" for h in b[1])
            rows = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>"
                           for row in b[2])
            out.append(f"<table><tr>{head}</tr>{rows}</table>")
        elif kind == "img":
            src = _image_source(b[1], embed_from)
            out.append(f"<p><img src='{src}' alt='{html.escape(b[2])}'></p>")
        else:
            raise ValueError(f"unknown block {kind!r}")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
