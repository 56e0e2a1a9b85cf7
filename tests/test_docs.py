"""The generated trait pages match what the installed vLLM and the adapters give."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from kvspec_traits._traits import trait_names
from kvspec_workbench import docgen

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "traits"


def render_pages() -> dict[str, str]:
    """The workbench's doc generator's pages (``make docs``)."""
    return docgen.render_pages()


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


# -- the pages as a reader meets them ------------------------------------------------------

PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` and ``_``
    dropped, spaces as ``-`` (``## Options (`kv_connector_extra_config`)`` is
    ``#options-kv_connector_extra_config``)."""
    text = heading.strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)}


def test_every_link_between_pages_resolves() -> None:
    """A relative link names a file that exists and, with ``#...``, one of its headings
    (pages were cut down and moved: a stale link is the first thing a reader trips on)."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_every_test_a_page_cites_exists() -> None:
    """Each ``tests/FILE.py::name`` a page gives as evidence is a test (or class) of that
    file: operating.md backs every statement about mixed pairs this way."""
    missing = []
    for page in PAGES:
        for ref in set(re.findall(r"tests/[\w/.-]+\.py::[\w:]+", page.read_text())):
            path, *names = ref.split("::")
            source = (ROOT / path).read_text() if (ROOT / path).exists() else ""
            missing += [
                f"{page.name}: {ref}"
                for name in names
                if not re.search(rf"^\s*(?:async )?(?:def|class) {name}\b", source, flags=re.M)
            ]
    assert missing == []


def test_no_page_is_a_dated_log() -> None:
    """Runs are written by the benchmarks to benchmarks/results/; a page says what holds
    (issue 49): no calendar date and no time of day in UTC."""
    dated = [
        f"{page.relative_to(ROOT)}:{i}: {line.strip()[:80]}"
        for page in sorted((ROOT / "docs").rglob("*.md"))
        for i, line in enumerate(page.read_text().splitlines(), 1)
        if re.search(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d(?:-\d\d:\d\d)? UTC\b", line)
    ]
    assert dated == []


def test_the_connector_page_reads_in_about_600_lines() -> None:
    lines = len((ROOT / "docs" / "vllm.md").read_text().splitlines())
    assert lines <= 620, f"docs/vllm.md has {lines} lines"


def test_the_readme_lists_every_page() -> None:
    section = (ROOT / "README.md").read_text().split("\n## Documentation\n", 1)[1]
    listed = section.split("\n## ", 1)[0]
    unlisted = [
        p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"`docs/{p.name}`" not in listed
    ]
    assert unlisted == []


def test_operating_names_the_option_and_each_unsafe_layout() -> None:
    """The rollout guide says what ``kvspec_require_traits_peer`` does with the connector's
    own refusal text, and names the layouts issue 50 asks for, each with its evidence."""
    from kvspec_traits.vllm_connector import REQUIRE_TRAITS_PEER, PeerWithoutTraitsError

    text = " ".join((ROOT / "docs" / "operating.md").read_text().split())
    assert f"`{REQUIRE_TRAITS_PEER}`" in text
    refusal = " ".join(str(PeerWithoutTraitsError("HOST:PORT")).split())
    assert refusal in text
    for layout in ("DeepSeek-V4's block rows on vLLM 0.32", "block size on prefill and decode"):
        assert layout in text, layout
    assert "test_deepseek_v4_differs_only_where_upstream_is_wrong" in text


def test_the_connector_page_lists_every_expected_difference() -> None:
    """The workbench's conformance/expected_differences.toml's header says docs/vllm.md
    lists its entries: each ``[[difference]]``'s vLLM test is named there."""
    entries = tomllib.loads(
        (
            ROOT / "tools" / "kvspec_workbench" / "conformance" / "expected_differences.toml"
        ).read_text()
    )
    text = (ROOT / "docs" / "vllm.md").read_text()
    named = [e["test"].split("::")[-1].split("[")[0] for e in entries.get("difference", [])]
    assert named, "no [[difference]] entry read"
    assert [n for n in named if f"{n}`" not in text] == []
