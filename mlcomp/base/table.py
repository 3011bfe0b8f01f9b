"""A plain-text table that also renders as Markdown, HTML and JSON (bench, studies, reports).

    >>> print(Table("t", ("model", "ms"), (("mlp", "0.08"),), right=frozenset({1})).format())
    t
    model    ms
    -----  ----
    mlp    0.08
"""
from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any, Sequence

__all__ = ["Table"]


@dataclass(frozen=True)
class Table:
    """A plain-text table: a title, column headers and rows of cells (already text)."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    right: frozenset[int] = frozenset()   # right-aligned column indexes (numbers)

    def format(self) -> str:
        widths = [len(c) for c in self.columns]
        for row in self.rows:
            for i, cell in enumerate(row):
                widths[i] = max(widths[i], len(cell))

        def line(cells: Sequence[str]) -> str:
            out = [c.rjust(w) if i in self.right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
            return "  ".join(out).rstrip()

        rule = "  ".join("-" * w for w in widths)
        body = [line(self.columns), rule] + [line(r) for r in self.rows]
        return "\n".join(([self.title] if self.title else []) + body)

    def to_markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        sep = "|" + "|".join("---:" if i in self.right else "---" for i in range(len(self.columns))) + "|"
        rows = ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in self.rows]
        return "\n".join(([f"**{self.title}**", ""] if self.title else []) + [head, sep] + rows)

    def to_html(self) -> str:
        def cell(tag: str, i: int, text: str) -> str:
            style = ' class="num"' if i in self.right else ""
            return f"<{tag}{style}>{escape(text)}</{tag}>"

        head = "".join(cell("th", i, c) for i, c in enumerate(self.columns))
        body = "".join("<tr>" + "".join(cell("td", i, c) for i, c in enumerate(r)) + "</tr>" for r in self.rows)
        caption = f"<caption>{escape(self.title)}</caption>" if self.title else ""
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def to_json(self) -> dict[str, Any]:
        return {"title": self.title, "columns": list(self.columns), "rows": [list(r) for r in self.rows],
                "right": sorted(self.right)}
