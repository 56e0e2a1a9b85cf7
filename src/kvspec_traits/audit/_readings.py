"""Readings of a site that depend on what its classes are and where it stands: a check
mixing vLLM's classes with out-of-tree ones is judged on vLLM's (docs/audit.md,
"Out-of-tree spec classes"); a test module and the module defining a class are told.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import replace

from kvspec_traits.audit._names import dedup
from kvspec_traits.audit._scan import RawSite
from kvspec_traits.audit._site import Site
from kvspec_traits.audit._universe import Universe

__all__ = ["defines", "in_test", "judged_on_vllm"]

_VLLM_ONLY: dict[int, tuple[Universe, Universe]] = {}


def _vllm_only(u: Universe) -> Universe:
    # ``u`` without the classes the scanned code defines (cached for the last universe).
    cached = _VLLM_ONLY.get(id(u))
    if cached is None or cached[0] is not u:
        own = {n: c for n, c in u.classes.items() if not c.out_of_tree}
        _VLLM_ONLY.clear()
        cached = _VLLM_ONLY[id(u)] = (u, dataclasses.replace(u, classes=own))
    return cached[1]


def judged_on_vllm(raw: RawSite, u: Universe, path: str, infer: Callable[..., Site]) -> Site | None:
    """A subclass-taking check on vLLM's classes, in code that defines out-of-tree ones,
    judged on the vLLM classes it tests plus each out-of-tree class's own first vLLM base
    (what that class stands for) against vLLM's classes only: out-of-tree classes neither
    dilute the trait sets nor hide a vLLM class the check leaves out (issue 23). An exact
    check is judged so only for its misses (the out-of-tree subclasses it skips are named
    from the whole class tree); otherwise it keeps the whole tree's verdict."""
    if not u.out_of_tree or raw.kinds or raw.form == "class-dict":
        return None
    oot = [c for c in raw.classes if c in u.out_of_tree]
    if not any(c in u.classes and c not in u.out_of_tree for c in raw.classes):
        return None
    base = {
        n: next((m for m in c.mro[1:] if not u.classes[m].out_of_tree), "")
        for n, c in u.classes.items()
        if c.out_of_tree
    }

    def as_vllm(names: Iterable[str]) -> tuple[str, ...]:
        return dedup(x for n in names if (x := base.get(n, n)))

    bases = [base[c] for c in oot]
    # the code around the check speaks of the out-of-tree classes the same way
    judged = replace(
        raw,
        classes=as_vllm(raw.classes),
        exited_on=as_vllm(raw.exited_on),
        constraints=tuple(replace(c, classes=as_vllm(c.classes)) for c in raw.constraints),
    )
    site = infer(judged, _vllm_only(u), path=path)
    note = (
        "; judged on vLLM's classes: the ones it tests and the bases of "
        + ", ".join(f"{c} ({b})" for c, b in zip(oot, bases, strict=True))
        if oot
        else ""
    )
    unknown = tuple(c for c in raw.classes if c in u.unknown)
    skipped = site.skipped_subclasses
    if raw.exact and not raw.subclass_safe:
        if site.verdict != "miss":
            return None
        below = {
            n
            for n in u.out_of_tree - set(raw.classes)
            if any(t in u.classes[n].mro[1:] for t in raw.classes)
        }
        skipped = tuple(sorted({*skipped, *below}))
    return replace(
        site, raw=raw, reason=site.reason + note, unknown=unknown, skipped_subclasses=skipped
    )


def in_test(path: str, function: str) -> bool:
    # A test module (test_*.py, *_test.py, conftest.py) or a test function. Not any file
    # under a tests/ folder: the scanned tree itself may live below one.
    name = path.replace("\\", "/").rpartition("/")[2]
    return (
        name.startswith("test_")
        or name.endswith("_test.py")
        or name == "conftest.py"
        or function.rpartition(".")[2].startswith("test")
    )


def defines(path: str, module: str) -> bool:
    # Whether the file at ``path`` is the module ``module`` (its dotted name as a path).
    tail = module.replace(".", "/")
    norm = path.replace("\\", "/").removesuffix(".py")
    return bool(module) and (norm == tail or norm.endswith("/" + tail))
