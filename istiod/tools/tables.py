"""Plain-text tables like istioctl's (Go tabwriter with a padding of three spaces)."""

from __future__ import annotations

from collections.abc import Sequence

PADDING = 3


def render(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(row[i])) for row in (headers, *rows)) for i in range(len(headers))]
    lines = [
        "".join(str(cell).ljust(width + PADDING) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (headers, *rows)
    ]
    return "\n".join(lines) + "\n"
