"""The README's benchmark tables: each benchmark rewrites the part of README.md between its
two markers (`<!-- NAME-table -->` and `<!-- /NAME-table -->`) with its latest table."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def update_readme(name: str, table: str, source: Path) -> Path:
    """Put table, with a link to the JSON it came from, between name's markers; the README."""
    begin, end = f"<!-- {name}-table -->", f"<!-- /{name}-table -->"
    text = README.read_text()
    start, stop = text.index(begin) + len(begin), text.index(end)
    where = source.relative_to(README.parent) if source.is_relative_to(README.parent) else source.name
    README.write_text(text[:start] + f"\nLatest run ([JSON]({where})):\n\n{table}\n" + text[stop:])
    return README
