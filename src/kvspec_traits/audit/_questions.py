"""The trait questions a class check can stand for, and how each is written with traits.

A question reads one class-level fact from a spec's traits and renders it as a label
(``"True"``, ``"TokenScope.RING"``). Only facts that are the same for every instance of
a typical class are questions: sizes, dtypes and block sizes differ per model, so a
class check never stands for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from kvspec_traits._kinds import TokenScope, TPLayout
from kvspec_traits._traits import KVLayoutTraits

__all__ = [
    "KIND_TRAITS",
    "QUESTIONS",
    "VALUE_SEPARATOR",
    "Question",
    "answer_values",
    "ask",
    "joined_values",
    "question_named",
]


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
    member_of: str = ""
    """For an enum trait, the expression asking for one of several values (``{v}`` is a
    tuple of members or a name bound to one); empty for a boolean trait."""
    not_member_of: str = ""

    def expression(self, subject: str, value: str, *, negated: bool) -> str:
        """The expression that asks this question of ``subject`` (negated for
        ``not isinstance`` / ``is not`` / ``not in`` sites). ``value`` is one label, or
        several joined by ``", "`` (a set of an enum trait's values, see
        :data:`VALUE_SEPARATOR`)."""
        if VALUE_SEPARATOR in value and self.member_of:
            return self.member_in(subject, f"({value})", negated=negated)
        if self.booleans:
            truthy = (value == "True") != negated
            return (self.positive if truthy else self.negative).format(s=subject, v=value)
        return (self.negative if negated else self.positive).format(s=subject, v=value)

    def member_in(self, subject: str, container: str, *, negated: bool) -> str:
        """``traits_of(subject).<trait> in <container>`` (``not in`` when negated)."""
        template = self.not_member_of if negated else self.member_of
        if not template:
            raise ValueError(f"{self.name} is a boolean trait: it has no set of values")
        return template.format(s=subject, v=container)


VALUE_SEPARATOR: Final = ", "
"""Joins the labels of an answer that is a set of one enum trait's values."""

_ORDER: Final = {_label(m): i for i, m in enumerate((*TokenScope, *TPLayout))}


def joined_values(labels: Iterable[str]) -> str:
    """Labels of one enum trait joined in the enum's own order (an answer's value)."""
    return VALUE_SEPARATOR.join(sorted(labels, key=lambda v: (_ORDER.get(v, len(_ORDER)), v)))


def answer_values(value: str) -> frozenset[str]:
    """The labels an answer's value stands for (one, or a set of an enum's values)."""
    return frozenset(value.split(VALUE_SEPARATOR))


def ask(
    trait: str, value: str, subject: str, *, negated: bool, unless: tuple[str, ...] = ()
) -> str:
    """The traits expression of an answer: ``trait`` asked for ``value`` of ``subject``,
    and, for ``A and not B`` read as two traits, ``and not`` the ``unless`` trait's value
    (``(trait, value)``; only with ``negated`` False)."""
    text = question_named(trait).expression(subject, value, negated=negated)
    if unless:
        if negated:
            raise ValueError("an answer with `unless` is asked only as written, not negated")
        other, other_value = unless
        text += " and " + question_named(other).expression(subject, other_value, negated=True)
    return text


def _flag(name: str, *, common: bool = False) -> Question:
    """A boolean trait asked as itself: ``traits_of(spec).<name>`` or its negation."""
    return Question(
        name=name,
        read=lambda t: _label(getattr(t, name)),
        positive=f"traits_of({{s}}).{name}",
        negative=f"not traits_of({{s}}).{name}",
        booleans=True,
        common=common,
    )


def _member(name: str) -> Question:
    """An enum trait asked for one member: ``traits_of(spec).<name> is <member>``."""
    return Question(
        name=name,
        read=lambda t: _label(getattr(t, name)),
        positive=f"traits_of({{s}}).{name} is {{v}}",
        negative=f"traits_of({{s}}).{name} is not {{v}}",
        booleans=False,
        member_of=f"traits_of({{s}}).{name} in {{v}}",
        not_member_of=f"traits_of({{s}}).{name} not in {{v}}",
    )


QUESTIONS: tuple[Question, ...] = (
    _flag("is_mla"),
    _member("token_scope"),
    _member("tp_layout"),
    Question(
        name="windowed",
        read=lambda t: _label(t.window_tokens is not None),
        positive="traits_of({s}).window_tokens is not None",
        negative="traits_of({s}).window_tokens is None",
        booleans=True,
    ),
    _flag("transferable"),
    _flag("uses_slot_mapping"),
    _flag("prefix_cacheable"),
    _flag("attention_page", common=True),
    _flag("token_paged", common=True),
    _flag("keeps_prompt"),
    _flag("holds_hidden_states"),
    _flag("grouped"),
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
