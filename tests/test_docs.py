"""The generated trait pages match what the installed vLLM and the adapters give."""

from __future__ import annotations

from pathlib import Path

from kvspec_traits._docgen import render_pages
from kvspec_traits._traits import trait_names

DOCS = Path(__file__).resolve().parents[1] / "docs" / "traits"


def test_one_committed_page_per_trait_and_each_is_current() -> None:
    pages = render_pages()
    assert set(pages) == {f"{n}.md" for n in trait_names()} | {"README.md"}
    stale = [f for f, text in pages.items()
             if not (DOCS / f).exists() or (DOCS / f).read_text() != text]
    assert stale == [], (
        f"docs/traits is stale for {stale}: run `.venv/bin/python -m kvspec_traits._docgen`")


def test_every_trait_page_says_where_the_value_comes_from() -> None:
    for name in trait_names():
        assert "Source:" in (DOCS / f"{name}.md").read_text(), name
