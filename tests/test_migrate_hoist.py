"""``migrate`` asks ``traits_of`` once per spec per function (issue 35, item 4): where a
function asks it more than once for the same subject, one local before the first use
replaces the calls, and only where that cannot ask on a path the code did not, nor answer
for a spec the name no longer holds.

Each case runs the function before and after, with a ``traits_of`` that counts its calls
and refuses ``None`` as the real one refuses a non-spec: the answers (and refusals) are
the same, and the hoisted version asks once."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

import pytest

from kvspec_traits.migrate._hoist import hoist_traits


@dataclass(frozen=True)
class _Traits:
    a: bool
    b: bool


class _Counting:
    """A ``traits_of`` stand-in that counts calls; ``None`` is refused, as a non-spec."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, spec: Any) -> _Traits:
        self.calls += 1
        if spec is None:
            raise TypeError("not a spec")
        return _Traits(a=spec % 2 == 0, b=spec > 2)


def _run(code: str, *args: Any) -> tuple[object, int]:
    counting = _Counting()
    namespace: dict[str, Any] = {"traits_of": counting}
    exec(compile(code, "<case>", "exec"), namespace)
    try:
        result: object = namespace["f"](*args)
    except TypeError as exc:
        result = f"raises {exc}"
    return result, counting.calls


HOISTED: dict[str, tuple[str, list[tuple[int, ...]]]] = {
    "two tests in a row": (
        """
        def f(s):
            if traits_of(s).a:
                return 1
            if traits_of(s).b:
                return 2
            return 3
        """,
        [(1,), (2,), (3,), (4,)],
    ),
    "in a loop body, per spec": (
        """
        def f(*specs):
            out = []
            for s in specs:
                x = traits_of(s).a
                out.append((x, traits_of(s).b))
            return out
        """,
        [(1, 2, 3, 4)],
    ),
    "the test of `a and b` and a later line": (
        """
        def f(s):
            y = traits_of(s).a and traits_of(s).b
            return y, traits_of(s).b
        """,
        [(3,), (4,)],
    ),
    "rebound in the last statement, after its test": (
        """
        def f(s):
            if traits_of(s).a and s > 3:
                return 0
            if not traits_of(s).a:
                s = None
            return s
        """,
        [(1,), (2,), (4,)],
    ),
    "a conditional expression's test": (
        """
        def f(s):
            x = 1 if traits_of(s).a else 2
            return x, traits_of(s).b
        """,
        [(1,), (4,)],
    ),
}

LEFT = {
    "first asked in an elif": """
        def f(s, flag):
            if flag:
                return 0
            elif traits_of(s).a:
                return 1
            return traits_of(s).b
        """,
    "first asked after a guard in the same test": """
        def f(s):
            if s is not None and traits_of(s).a:
                return 1
            return s is not None and traits_of(s).b
        """,
    "rebound between two uses": """
        def f(s, t):
            x = traits_of(s).a
            s = t
            return x, traits_of(s).b
        """,
    "first asked in an assert": """
        def f(s):
            assert traits_of(s).a
            return traits_of(s).b
        """,
    "twice in one comprehension": """
        def f(specs):
            return [traits_of(s).a and traits_of(s).b for s in specs]
        """,
    "the local's name is taken": """
        def f(s):
            s_traits = 5
            return traits_of(s).a, traits_of(s).b, s_traits
        """,
}


@pytest.mark.parametrize("name", sorted(HOISTED))
def test_hoisted_once_with_the_same_answers(name: str) -> None:
    source, calls = HOISTED[name]
    before = textwrap.dedent(source)
    after, left = hoist_traits(before)
    assert left == 0
    assert after != before
    assert after.count("traits_of(") == 1, after
    for args in calls:
        want, asked_before = _run(before, *args)
        got, asked_after = _run(after, *args)
        assert got == want, (name, args)
        # once per spec the function reads: each of the loop's specs, else the one
        assert asked_after == len(args), (after, args)
        assert asked_before > asked_after or asked_before == len(args)


@pytest.mark.parametrize("name", sorted(LEFT))
def test_left_where_one_call_would_ask_otherwise(name: str) -> None:
    before = textwrap.dedent(LEFT[name])
    after, left = hoist_traits(before)
    assert after == before
    assert left == 1


def test_a_guard_keeps_its_refusal_path() -> None:
    """Hoisted above ``s is not None and ...``, the call would refuse None: left, so a
    None is answered, never refused."""
    before = textwrap.dedent(LEFT["first asked after a guard in the same test"])
    assert _run(before, None) == (False, 0)
    assert _run(hoist_traits(before)[0], None) == (False, 0)


def test_specs_of_separate_comprehensions_are_not_repeats() -> None:
    """Two comprehensions each bind their own ``s``: different specs, nothing to hoist
    and nothing reported left."""
    before = textwrap.dedent(
        """
        def f(xs, ys):
            return any(traits_of(s).a for s in xs), all(traits_of(s).b for s in ys)
        """
    )
    assert hoist_traits(before) == (before, 0)
