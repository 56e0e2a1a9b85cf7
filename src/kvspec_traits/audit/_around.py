"""What the code around a check decides, applied to the class sets: the classes the
constraints and trait guards the scanner recorded keep from reaching a site
(docs/audit.md, "What the code around a check decides"), and the words that say why.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvspec_traits.audit._flow import Constraint
from kvspec_traits.audit._scan import RawSite
from kvspec_traits.audit._universe import Universe

__all__ = ["blocked_classes", "flow_reason", "of_kinds"]


def of_kinds(u: Universe, kinds: Iterable[str]) -> frozenset[str]:
    # The concrete classes vLLM's get_kv_cache_spec_kind maps into ``kinds``.
    wanted = set(kinds)
    return frozenset(n for n in u.concrete if u.kinds.get(n) and u.kinds[n] <= wanted)


def _hit(c: Constraint, u: Universe) -> frozenset[str]:
    # The classes a constraint speaks of (``kind:X`` entries: a spec-kind check's).
    kinds = [k.removeprefix("kind:") for k in c.classes if k.startswith("kind:")]
    names = [k for k in c.classes if not k.startswith("kind:")]
    hit = frozenset(names) & u.concrete if c.exact else u.subclasses(names)
    return hit | of_kinds(u, kinds) if kinds else hit


def blocked_classes(raw: RawSite, u: Universe) -> frozenset[str]:
    # Classes the surrounding code keeps from reaching the check.
    blocked: set[str] = set()
    for c in raw.constraints:
        hit = _hit(c, u)
        if c.mode == "exclude":
            blocked |= hit
        else:
            blocked |= u.concrete - hit
    for g in raw.trait_guards:
        blocked |= {n for n in u.concrete if u.values(g.name, n) == {g.excluded}}
    return frozenset(blocked)


def flow_reason(raw: RawSite, u: Universe, excluded: frozenset[str]) -> str:
    whys: list[str] = []
    for c in raw.constraints:
        hit = _hit(c, u)
        if (hit & excluded) if c.mode == "exclude" else (excluded - hit):
            whys.append(f"{c.why} at line {c.line}")
    for g in raw.trait_guards:
        if any(u.values(g.name, n) == {g.excluded} for n in excluded):
            whys.append(f"a {g.name} guard at line {g.line}")
    return ", ".join(dict.fromkeys(whys)) or "the code before it"
