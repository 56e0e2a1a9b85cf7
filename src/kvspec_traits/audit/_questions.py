"""The trait questions a class check can stand for, and how each is written with traits.

A question reads one class-level fact from a spec's traits and renders it as a label
(``"True"``, ``"TokenScope.RING"``). Only facts that are the same for every instance of
a typical class are questions: sizes, dtypes and block sizes differ per model, so a
class check never stands for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvspec_traits._traits import KVLayoutTraits

__all__ = ["KIND_TRAITS", "QUESTIONS", "Question", "question_named"]


def _label(value: object) -> str:
    if isinstance(value, bool):
        return str(value)
    name = getattr(value, "name", None)
    if isinstance(name, str):  # an enum member
        return f"{type(value).__name__}.{name}"
    return repr(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Question:
    """One trait question: ``name`` is what the report prints, ``read`` the traits
    accessor, ``positive``/``negative`` render a value as a replacement expression
    (``{s}`` is the spec expression, ``{v}`` the value label)."""

    name: str
    read: Callable[[KVLayoutTraits], str]
    positive: str
    negative: str
    booleans: bool
    common: bool = False
    """Whether a value most classes have is still a question, matched exactly only:
    ``isinstance(spec, AttentionSpec)`` asks for every attention page."""

    def expression(self, subject: str, value: str, *, negated: bool) -> str:
        """The expression that asks this question of ``subject`` (negated for
        ``not isinstance`` / ``is not`` / ``not in`` sites)."""
        if self.booleans:
            truthy = (value == "True") != negated
            return (self.positive if truthy else self.negative).format(s=subject, v=value)
        return (self.negative if negated else self.positive).format(s=subject, v=value)


QUESTIONS: tuple[Question, ...] = (
    Question(
        name="is_mla",
        read=lambda t: _label(t.is_mla),
        positive="traits_of({s}).is_mla",
        negative="not traits_of({s}).is_mla",
        booleans=True,
    ),
    Question(
        name="token_scope",
        read=lambda t: _label(t.token_scope),
        positive="traits_of({s}).token_scope is {v}",
        negative="traits_of({s}).token_scope is not {v}",
        booleans=False,
    ),
    Question(
        name="tp_layout",
        read=lambda t: _label(t.tp_layout),
        positive="traits_of({s}).tp_layout is {v}",
        negative="traits_of({s}).tp_layout is not {v}",
        booleans=False,
    ),
    Question(
        name="windowed",
        read=lambda t: _label(t.window_tokens is not None),
        positive="traits_of({s}).window_tokens is not None",
        negative="traits_of({s}).window_tokens is None",
        booleans=True,
    ),
    Question(
        name="transferable",
        read=lambda t: _label(t.transferable),
        positive="traits_of({s}).transferable",
        negative="not traits_of({s}).transferable",
        booleans=True,
    ),
    Question(
        name="uses_slot_mapping",
        read=lambda t: _label(t.uses_slot_mapping),
        positive="traits_of({s}).uses_slot_mapping",
        negative="not traits_of({s}).uses_slot_mapping",
        booleans=True,
    ),
    Question(
        name="prefix_cacheable",
        read=lambda t: _label(t.prefix_cacheable),
        positive="traits_of({s}).prefix_cacheable",
        negative="not traits_of({s}).prefix_cacheable",
        booleans=True,
    ),
    Question(
        name="attention_page",
        read=lambda t: _label(t.attention_page),
        positive="traits_of({s}).attention_page",
        negative="not traits_of({s}).attention_page",
        booleans=True,
        common=True,
    ),
    Question(
        name="token_paged",
        read=lambda t: _label(t.token_paged),
        positive="traits_of({s}).token_paged",
        negative="not traits_of({s}).token_paged",
        booleans=True,
        common=True,
    ),
    Question(
        name="keeps_prompt",
        read=lambda t: _label(t.keeps_prompt),
        positive="traits_of({s}).keeps_prompt",
        negative="not traits_of({s}).keeps_prompt",
        booleans=True,
    ),
    Question(
        name="grouped",
        read=lambda t: _label(t.grouped),
        positive="traits_of({s}).grouped",
        negative="not traits_of({s}).grouped",
        booleans=True,
    ),
)
"""In order of preference when two questions fit a branch equally well."""

KIND_TRAITS: tuple[str, ...] = ("transferable", "uses_slot_mapping")
"""The page kind: a connector handles pages it never moves, or writes without a slot
mapping, on code paths of their own, so a branch is compared only with classes of its
own kind (see docs/audit.md, "Which classes count as missed")."""


def question_named(name: str) -> Question:
    """The question called ``name``; ``KeyError`` names the known ones."""
    for q in QUESTIONS:
        if q.name == name:
            return q
    raise KeyError(f"no trait question {name!r}; known: {', '.join(q.name for q in QUESTIONS)}")
