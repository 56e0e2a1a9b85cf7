"""Readings of a site that depend on what its classes are and where it stands: a check
mixing vLLM's classes with out-of-tree ones is judged on vLLM's, and a miss beside a
vendor subclass of the missed class is latent where nothing builds the class (docs/audit.md,
"Vendor subclasses"); a test module and the module defining a class are told.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Final

from kvspec_traits.audit._names import dedup
from kvspec_traits.audit._scan import RawSite
from kvspec_traits.audit._site import Confidence, Site
from kvspec_traits.audit._universe import Universe

__all__ = ["defines", "in_test", "judged_on_vllm", "latent"]

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
    judged on the vLLM classes it tests against vLLM's classes only: out-of-tree classes
    neither dilute the trait sets nor hide a vLLM class the check leaves out (issue 23).
    An out-of-tree class the check tests covers itself and its subclasses, never its vLLM
    base (issue 49: a miss of that base is latent at most, see :func:`latent`); in the
    code around the check (exits, enclosing tests) each stands for its first vLLM base.
    An exact check is judged so only for its misses (the out-of-tree subclasses it skips
    are named from the whole class tree); otherwise it keeps the whole tree's verdict."""
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

    def vllm_only(names: Iterable[str]) -> tuple[str, ...]:
        return tuple(n for n in names if n not in u.out_of_tree)

    # An out-of-tree class counts for itself, never for its base: in the check, and in an
    # exit or an early exit around it (a plain instance of the base passes those). Code
    # that only an out-of-tree class's instances reach (an enclosing test on it) is
    # reached by instances laid out as its base.
    judged = replace(
        raw,
        classes=vllm_only(raw.classes),
        exited_on=vllm_only(raw.exited_on),
        constraints=tuple(
            replace(c, classes=as_vllm(c.classes) if c.mode == "require" else vllm_only(c.classes))
            for c in raw.constraints
        ),
    )
    site = infer(judged, _vllm_only(u), path=path)
    note = (
        "; judged on the vLLM classes it tests ("
        + ", ".join(f"{c} counts for itself, not for its base {base[c]}" for c in oot)
        + ")"
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
    site = replace(
        site, raw=raw, reason=site.reason + note, unknown=unknown, skipped_subclasses=skipped
    )
    return latent(site, raw, u)


_LOWER: Final[dict[Confidence, Confidence]] = {"high": "medium", "medium": "low", "low": "low"}


def _vendor(u: Universe, name: str) -> bool:
    info = u.classes.get(name)
    return info is not None and info.vendor


def latent(site: Site, raw: RawSite, u: Universe) -> Site:
    """A miss of a vLLM class the check leaves out beside a vendor subclass of it
    (``isinstance(spec, (MLAAttentionSpec, AscendSlidingWindowMLASpec))`` leaves out
    ``SlidingWindowMLASpec``) stays a miss; where the scanned code builds no instance of
    the left-out class (``raw.built``), it is right today only because the platform builds
    its own subclass instead: a latent miss, one step lower in confidence (issue 49).
    A miss of any class the check names no vendor subclass of keeps its confidence."""
    if site.verdict != "miss":
        return site
    named = dedup([*raw.classes, *raw.exited_on, *(n for c in raw.constraints for n in c.classes)])
    beside = {
        m: [c for c in named if _vendor(u, c) and m in u.classes[c].mro[1:]] for m in site.missing
    }
    unbuilt = {m: subs for m, subs in beside.items() if subs and m not in raw.built}
    if not unbuilt:
        return site
    confidence = _LOWER[site.confidence] if len(unbuilt) == len(site.missing) else site.confidence
    why = ", ".join(
        f"{m} (the code names its subclass {', '.join(subs)})" for m, subs in unbuilt.items()
    )
    return replace(
        site,
        confidence=confidence,
        reason=f"{site.reason}; latent: the scanned code builds no instance of {why} today",
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
