"""The generated trait pages match what the installed vLLM and the adapters give."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvspec_traits._traits import trait_names

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "traits"


def render_pages() -> dict[str, str]:
    """scripts/docgen.py's pages (a repository tool, loaded from its file)."""
    spec = importlib.util.spec_from_file_location("docgen", ROOT / "scripts" / "docgen.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(ROOT / "scripts" / "docgen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pages: dict[str, str] = module.render_pages()
    return pages


def test_one_committed_page_per_trait_and_each_is_current() -> None:
    pages = render_pages()
    assert set(pages) == {f"{n}.md" for n in trait_names()} | {"README.md"}
    stale = [
        f for f, text in pages.items() if not (DOCS / f).exists() or (DOCS / f).read_text() != text
    ]
    assert stale == [], f"docs/traits is stale for {stale}: run `make docs`"


def test_every_trait_page_says_where_the_value_comes_from() -> None:
    for name in trait_names():
        assert "Source:" in (DOCS / f"{name}.md").read_text(), name
