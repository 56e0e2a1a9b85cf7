"""A delay for NIXL's progress thread, which NIXL's Python API leaves at zero.

NIXL 1.5.1's ``nixl_agent`` builds its C++ agent config with ``pthrDelay = 0``
(``nixl_cu12/_api.py``), and callers cannot change this. With a progress thread (NIXL's
default, and vLLM's NIXL worker builds its agents that way), the thread then polls
without sleeping. ``benchmarks/bench_nixl_progress.py`` measures this: on the 2-core
machine an idle agent held 1.00 of a core at delay 0 and 0.03 at 100 us. A
prefill/decode pair on two cores runs two such pollers beside two engines.

:func:`progress_delay` sets a floor under that delay for the agents built inside it,
and only for those. It does this by substituting, for the duration of the block, a
subclass of NIXL's own ``nixlAgentConfig`` whose ``pthrDelay`` setter keeps at least
the floor. NIXL's C++ agent reads the value when it is constructed. Agents built before
or after the block, and elsewhere in the process, keep NIXL's zero.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvspec_traits._errors import KVSpecTraitsError

__all__ = ["ProgressDelayError", "progress_delay"]

_LOCK = threading.Lock()
MAX_DELAY_US = 1_000_000
"""One second: a larger floor would stall every transfer's progress."""


class ProgressDelayError(KVSpecTraitsError, ValueError):
    """A progress-thread delay that is not a whole number of microseconds in
    ``[0, MAX_DELAY_US]``."""


def check_delay(delay_us: object, what: str = "progress delay") -> int:
    """``delay_us`` as an int, or :class:`ProgressDelayError` naming ``what``."""
    if isinstance(delay_us, bool) or not isinstance(delay_us, int | float):
        raise ProgressDelayError(f"{what} is {delay_us!r}; give whole microseconds, e.g. 100")
    if isinstance(delay_us, float) and (not math.isfinite(delay_us) or delay_us != int(delay_us)):
        raise ProgressDelayError(f"{what} is {delay_us!r}; give whole microseconds, e.g. 100")
    value = int(delay_us)
    if not 0 <= value <= MAX_DELAY_US:
        raise ProgressDelayError(
            f"{what} is {value} us; give 0 (NIXL's own busy polling) to {MAX_DELAY_US} us"
        )
    return value


def delayed_agent_config(native: Any, floor: int) -> Any:
    """A subclass of NIXL's ``nixlAgentConfig`` (``native``) whose ``pthrDelay`` setter
    keeps at least ``floor`` microseconds."""

    class _DelayedConfig(native):  # type: ignore[misc]  # NIXL's pybind class
        @property
        def pthrDelay(self) -> int:  # NIXL's name
            return int(native.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            native.pthrDelay.__set__(self, max(int(value), floor))

    return _DelayedConfig


@contextmanager
def progress_delay(delay_us: int) -> Iterator[None]:
    """NIXL agents built inside the block give their progress thread at least
    ``delay_us`` microseconds between polls (0: NIXL's own behaviour, nothing changes)."""
    floor = check_delay(delay_us)
    if floor == 0:
        yield
        return
    from nixl._api import nixlBind  # the bindings module the agent constructor reads

    native: Any = nixlBind.nixlAgentConfig
    with _LOCK:
        nixlBind.nixlAgentConfig = delayed_agent_config(native, floor)
        try:
            yield
        finally:
            nixlBind.nixlAgentConfig = native
