"""A bench report's last step: its Markdown printed and written (every script's tail)."""

from __future__ import annotations

from pathlib import Path


def write_report(lines: list[str], path: str | Path) -> int:
    """Print ``lines`` as one Markdown text and write it to ``path``; returns 0, the
    script's exit status."""
    text = "\n".join(lines) + "\n"
    print(text)
    Path(path).write_text(text)
    return 0
