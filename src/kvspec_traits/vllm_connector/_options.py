"""The connector's ``kv_connector_extra_config`` keys, read once: :class:`ConnectorOptions`.

vLLM hands a connector one ``kv_connector_extra_config`` dict. The connector parses
every key it reads here, at once, when it is built (before any NIXL agent exists), and
hands the parsed object to its worker; nothing else reads the dict. A value of the
wrong type or out of range is a :class:`ConnectorOptionError` naming the key, the value
and what to give; a ``kvspec_`` key the connector does not read (a typo) is an
:class:`UnknownConnectorOptionError` naming the closest one. Keys without the prefix
are vLLM's (``backends``, ``bidirectional_kv_xfer``, ...) and left to it, but for
``transfer_mode``, which the connector reads where vLLM's factory does.

Pure: importing it imports no vLLM (only the NIXL shim's progress-delay check).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Final, Literal

from kvspec_traits.nixl._progress import MAX_DELAY_US, ProgressDelayError, check_delay
from kvspec_traits.vllm_connector._errors import (
    ConnectorOptionError,
    UnknownConnectorOptionError,
    UnsupportedTransferModeError,
)
from kvspec_traits.vllm_connector._gate import check_vllm_version, vllm_series
from kvspec_traits.vllm_connector._lease import DEFAULT_MARGIN, LEASE_MARGIN_KEY, LeaseMarginError
from kvspec_traits.vllm_connector._names import (
    NIXL_PROGRESS_DELAY,
    REQUIRE_TRAITS_PEER,
    SHM_WAIT,
    TRANSFER_MODE,
)
from kvspec_traits.vllm_connector._quirks import series_quirks
from kvspec_traits.vllm_connector._shm_wait import ShmWait, ShmWaitError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["ConnectorOptions", "ProgressDelayOptionError", "TransferMode", "connector_options"]

PREFIX: Final = "kvspec_"
"""The prefix of the connector's own keys: an unknown key with it is refused."""

TransferMode = Literal["pull", "push"]


class ProgressDelayOptionError(ConnectorOptionError, ProgressDelayError):
    """:data:`~._names.NIXL_PROGRESS_DELAY` is not whole microseconds from 0 to
    ``MAX_DELAY_US``: a :class:`ConnectorOptionError`, and the NIXL shim's
    ``ProgressDelayError`` that ``progress_delay`` raises for the same value."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorOptions:
    """Every ``kv_connector_extra_config`` key the connector reads, parsed and checked.

    Built by :func:`connector_options` (what the connector does) or
    :meth:`from_extra_config`; built by hand or by ``dataclasses.replace``, the values
    are checked the same way. Each field's ``metadata["key"]`` is its key. A value it
    cannot use raises a :class:`ConnectorOptionError` (``.key``, ``.value``):
    :class:`UnsupportedTransferModeError`, :class:`ShmWaitError`,
    :class:`LeaseMarginError` or :class:`ProgressDelayOptionError` for those keys, the
    base class itself for :data:`~._names.REQUIRE_TRAITS_PEER`.
    """

    transfer_mode: TransferMode = field(default="pull", metadata={"key": TRANSFER_MODE})
    """vLLM's key: ``"pull"``, or ``"push"`` (``TraitsNixlConnector`` then builds the push
    connector), read on the series whose factory reads it (0.34 and later), else ``"pull"``;
    ``"push"`` for ``TraitsNixlPushConnector``, push by its name."""
    require_traits_peer: bool = field(default=False, metadata={"key": REQUIRE_TRAITS_PEER})
    """Refuse a peer without a traits fingerprint (``PeerWithoutTraitsError``). A JSON
    boolean only: the string ``"false"`` is refused, never read as true."""
    nixl_progress_delay_us: int = field(default=0, metadata={"key": NIXL_PROGRESS_DELAY})
    """Microseconds the worker's NIXL progress thread sleeps between polls (0: NIXL's)."""
    shm_wait: ShmWait = field(default="yield", metadata={"key": SHM_WAIT})
    """How vLLM's shared-memory queues wait in this process (:mod:`._shm_wait`)."""
    lease_margin: float = field(default=DEFAULT_MARGIN, metadata={"key": LEASE_MARGIN_KEY})
    """Seconds a pull consumer keeps in reserve before a producer's lease (:mod:`._lease`)."""

    def __post_init__(self) -> None:
        # Checked (and normalised: 100.0 us is 100, a margin of 2 is 2.0) however the
        # object was made; frozen, so set through object.
        checked = {
            "transfer_mode": _transfer_mode(self.transfer_mode),
            "require_traits_peer": _boolean(REQUIRE_TRAITS_PEER, self.require_traits_peer),
            "nixl_progress_delay_us": _progress_delay(self.nixl_progress_delay_us),
            "shm_wait": _shm_wait(self.shm_wait),
            "lease_margin": _lease_margin(self.lease_margin),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, object], *, series: str, mode: TransferMode | None = None
    ) -> ConnectorOptions:
        """The options of a ``kv_connector_extra_config`` on vLLM ``series`` (``"0.34"``):
        every key read and checked at once; an unknown ``kvspec_`` key is refused first
        (:class:`UnknownConnectorOptionError`), a missing key keeps its default.

        ``transfer_mode`` is read where vLLM's factory reads it for ``"NixlConnector"``
        (:attr:`~._quirks.SeriesQuirks.transfer_mode_key`: 0.34 and later), unless
        ``mode`` is given: a connector whose
        class is its mode (``TraitsNixlPushConnector``, as upstream's
        ``NixlPushConnector``) reads no such key."""
        keys = {f.metadata["key"]: f.name for f in fields(cls)}
        ours = sorted(key for key in keys if key.startswith(PREFIX))
        for key, value in extra.items():
            if isinstance(key, str) and key.startswith(PREFIX) and key not in keys:
                raise UnknownConnectorOptionError(key, value, ours)
        given: dict[str, Any] = {name: extra[key] for key, name in keys.items() if key in extra}
        if mode is not None:
            given["transfer_mode"] = mode
        elif not series_quirks(series).transfer_mode_key:
            given.pop("transfer_mode", None)  # vLLM's factory ignores it there; so do we
        return cls(**given)


def connector_options(
    vllm_config: VllmConfig, *, mode: TransferMode | None = None
) -> ConnectorOptions:
    """The options of ``vllm_config``'s ``kv_connector_extra_config`` (the defaults
    without a transfer config), as the connector reads them when it is built
    (:meth:`ConnectorOptions.from_extra_config`; ``mode`` as there). Checks the installed
    vLLM first (``UnsupportedVllmVersionError``, before any key is read): the series
    decides whether ``transfer_mode`` is read."""
    series = vllm_series(check_vllm_version())
    config = vllm_config.kv_transfer_config
    extra = {} if config is None else config.kv_connector_extra_config
    return ConnectorOptions.from_extra_config(extra, series=series, mode=mode)


def _transfer_mode(value: object) -> TransferMode:
    if isinstance(value, str) and value == "pull":
        return "pull"
    if isinstance(value, str) and value == "push":
        return "push"
    raise UnsupportedTransferModeError(value)


def _boolean(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise ConnectorOptionError(
        key, value, "give true or false, a JSON boolean (not a string or a number)"
    )


def _progress_delay(value: object) -> int:
    try:
        return check_delay(value, NIXL_PROGRESS_DELAY)  # the one check, progress_delay's
    except ProgressDelayError as err:
        raise ProgressDelayOptionError(
            NIXL_PROGRESS_DELAY,
            value,
            f"give whole microseconds from 0 (NIXL's own busy polling) to {MAX_DELAY_US}, e.g. 100",
        ) from err


def _shm_wait(value: object) -> ShmWait:
    if isinstance(value, str) and value == "yield":
        return "yield"
    if isinstance(value, str) and value == "sleep":
        return "sleep"
    raise ShmWaitError(
        SHM_WAIT,
        value,
        'give "yield" (vLLM\'s default: os.sched_yield() between checks) or "sleep" '
        "(time.sleep(0) between checks)",
    )


def _lease_margin(value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):  # JSON true: no time
        try:
            margin = float(value)
        except OverflowError:  # an int past float's range
            margin = math.inf
        if math.isfinite(margin) and margin >= 0:
            return margin
    raise LeaseMarginError(
        LEASE_MARGIN_KEY, value, f"give a finite number of seconds >= 0 ({DEFAULT_MARGIN} if unset)"
    )
