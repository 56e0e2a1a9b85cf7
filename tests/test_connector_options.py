"""The connector's ``kv_connector_extra_config`` keys, read once (``vllm_connector._options``).

Every key the connector reads is parsed and checked at once, when vLLM builds the
connector (pull and push, scheduler and worker role), before any NIXL agent exists or
any process-wide switch is set; the one parsed :class:`ConnectorOptions` is what the
worker uses (its peer check, its agent's progress delay, its lease margin). A value of
the wrong JSON type or out of range is a named error carrying the key and the value; a
``kvspec_`` typo names the key meant; vLLM's own keys are left to vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, cast, get_args

import msgspec
import pytest
from nixl._api import nixlBind
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import utils as vllm_utils
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPushConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

from kvspec_traits import KVSpecTraitsError
from kvspec_traits._deps import SUPPORTED_VLLM_SERIES
from kvspec_traits.nixl._progress import MAX_DELAY_US, ProgressDelayError
from kvspec_traits.vllm_connector import (
    NIXL_PROGRESS_DELAY,
    REQUIRE_TRAITS_PEER,
    SHM_WAIT,
    ConnectorOptionError,
    ConnectorOptions,
    LeaseMarginError,
    PeerWithoutTraitsError,
    ProgressDelayOptionError,
    ShmWaitError,
    TraitsNixlConnector,
    TraitsNixlPushConnector,
    UnknownConnectorOptionError,
    UnsupportedTransferModeError,
    UnsupportedVllmVersionError,
    _gate,
    connector_options,
)
from kvspec_traits.vllm_connector._lease import LEASE_MARGIN_KEY
from kvspec_traits.vllm_connector._names import SHM_WAITS, TRANSFER_MODE
from kvspec_traits.vllm_connector._shm_wait import ShmWait
from tests.nixl_helpers import layouts
from tests.nixl_helpers.layouts import LLAMA
from tests.test_connector_differential import (
    AGREE,
    LBHNC,
    NB,
    _construct,
    _gqa,
    _vllm_config,
    distributed,
)
from tests.test_push_switch import _upstream_class

pytestmark = pytest.mark.timeout(300)
__all__ = ["distributed"]  # a fixture, imported for its name

REPO = pathlib.Path(__file__).resolve().parents[1]
KEYS = {f.metadata["key"]: f.name for f in dataclasses.fields(ConnectorOptions)}
OURS = sorted(key for key in KEYS if key.startswith("kvspec_"))


def _parse(extra: dict[str, Any], series: str = "0.34") -> ConnectorOptions:
    return ConnectorOptions.from_extra_config(extra, series=series)


# -- the parse, key by key -------------------------------------------------------------


def test_the_keys_and_their_defaults() -> None:
    assert KEYS == {
        TRANSFER_MODE: "transfer_mode",
        REQUIRE_TRAITS_PEER: "require_traits_peer",
        NIXL_PROGRESS_DELAY: "nixl_progress_delay_us",
        SHM_WAIT: "shm_wait",
        LEASE_MARGIN_KEY: "lease_margin",
    }
    defaults = ConnectorOptions()
    assert dataclasses.asdict(defaults) == {
        "transfer_mode": "pull",
        "require_traits_peer": False,
        "nixl_progress_delay_us": 0,
        "shm_wait": "yield",
        "lease_margin": 2.0,
    }
    for series in SUPPORTED_VLLM_SERIES:
        assert _parse({}, series) == defaults
    assert get_args(ShmWait) == SHM_WAITS


VALID: list[tuple[str, object, object]] = [
    (TRANSFER_MODE, "pull", "pull"),
    (TRANSFER_MODE, "push", "push"),
    (REQUIRE_TRAITS_PEER, True, True),
    (REQUIRE_TRAITS_PEER, False, False),
    (NIXL_PROGRESS_DELAY, 0, 0),
    (NIXL_PROGRESS_DELAY, 100, 100),
    (NIXL_PROGRESS_DELAY, 100.0, 100),  # a JSON number with a zero fraction: whole us
    (NIXL_PROGRESS_DELAY, MAX_DELAY_US, MAX_DELAY_US),
    (SHM_WAIT, "yield", "yield"),
    (SHM_WAIT, "sleep", "sleep"),
    (LEASE_MARGIN_KEY, 0, 0.0),
    (LEASE_MARGIN_KEY, 0.5, 0.5),
    (LEASE_MARGIN_KEY, 2, 2.0),
]


@pytest.mark.parametrize(("key", "given", "parsed"), VALID)
def test_every_key_reads_its_valid_values(key: str, given: object, parsed: object) -> None:
    options = _parse({key: given})
    value = getattr(options, KEYS[key])
    assert value == parsed and type(value) is type(parsed)
    changed: dict[str, Any] = {KEYS[key]: parsed}
    assert options == dataclasses.replace(ConnectorOptions(), **changed)  # the rest: defaults


# (key, value given, the error, what the message says to give)
INVALID: list[tuple[str, object, type[ConnectorOptionError], str]] = [
    (TRANSFER_MODE, "write", UnsupportedTransferModeError, '"pull" (the default) or "push"'),
    (TRANSFER_MODE, "PUSH", UnsupportedTransferModeError, '"pull" (the default) or "push"'),
    (TRANSFER_MODE, None, UnsupportedTransferModeError, '"pull" (the default) or "push"'),
    (TRANSFER_MODE, True, UnsupportedTransferModeError, '"pull" (the default) or "push"'),
    (REQUIRE_TRAITS_PEER, "false", ConnectorOptionError, "give true or false, a JSON boolean"),
    (REQUIRE_TRAITS_PEER, "true", ConnectorOptionError, "give true or false, a JSON boolean"),
    (REQUIRE_TRAITS_PEER, 0, ConnectorOptionError, "give true or false, a JSON boolean"),
    (REQUIRE_TRAITS_PEER, 1, ConnectorOptionError, "give true or false, a JSON boolean"),
    (REQUIRE_TRAITS_PEER, None, ConnectorOptionError, "give true or false, a JSON boolean"),
    (
        NIXL_PROGRESS_DELAY,
        -1,
        ProgressDelayOptionError,
        f"from 0 (NIXL's own busy polling) to {MAX_DELAY_US}",
    ),
    (NIXL_PROGRESS_DELAY, MAX_DELAY_US + 1, ProgressDelayOptionError, "whole microseconds"),
    (NIXL_PROGRESS_DELAY, 1.5, ProgressDelayOptionError, "whole microseconds"),
    (NIXL_PROGRESS_DELAY, math.inf, ProgressDelayOptionError, "whole microseconds"),
    (NIXL_PROGRESS_DELAY, "100", ProgressDelayOptionError, "whole microseconds"),
    (NIXL_PROGRESS_DELAY, True, ProgressDelayOptionError, "whole microseconds"),
    (SHM_WAIT, "nap", ShmWaitError, '"yield"'),
    (SHM_WAIT, "Sleep", ShmWaitError, '"sleep" (time.sleep(0) between checks)'),
    (SHM_WAIT, 0, ShmWaitError, '"yield"'),
    (SHM_WAIT, ["sleep"], ShmWaitError, '"yield"'),
    (LEASE_MARGIN_KEY, -1, LeaseMarginError, "a finite number of seconds >= 0"),
    (LEASE_MARGIN_KEY, math.nan, LeaseMarginError, "a finite number of seconds >= 0"),
    (LEASE_MARGIN_KEY, math.inf, LeaseMarginError, "a finite number of seconds >= 0"),
    (LEASE_MARGIN_KEY, 10**400, LeaseMarginError, "a finite number of seconds >= 0"),
    (LEASE_MARGIN_KEY, "2", LeaseMarginError, "a finite number of seconds >= 0"),
    (LEASE_MARGIN_KEY, True, LeaseMarginError, "a finite number of seconds >= 0"),
]


@pytest.mark.parametrize(("key", "bad", "error", "instead"), INVALID)
def test_every_key_refuses_its_invalid_values_by_name(
    key: str, bad: object, error: type[ConnectorOptionError], instead: str
) -> None:
    with pytest.raises(error) as info:
        _parse({SHM_WAIT: "sleep", key: bad} if key != SHM_WAIT else {key: bad})
    err = info.value
    assert type(err) is error
    assert isinstance(err, KVSpecTraitsError) and isinstance(err, ValueError)
    assert err.key == key and err.value is bad
    message = str(err)
    assert f"kv_connector_extra_config {key!r} is {repr(bad)[:40]}" in message
    assert instead in message


def test_the_string_false_never_turns_the_peer_check_on() -> None:
    # bool("false") is True: the reason a string must be refused, not read.
    for text in ("false", "False", "0", ""):
        with pytest.raises(ConnectorOptionError, match="a JSON boolean"):
            _parse({REQUIRE_TRAITS_PEER: text})
    assert _parse({REQUIRE_TRAITS_PEER: False}).require_traits_peer is False


def test_the_progress_delay_error_is_the_nixl_shims_too() -> None:
    with pytest.raises(ProgressDelayError) as info:  # what progress_delay() raises
        _parse({NIXL_PROGRESS_DELAY: -5})
    assert isinstance(info.value, ConnectorOptionError) and info.value.key == NIXL_PROGRESS_DELAY


@pytest.mark.parametrize("series", SUPPORTED_VLLM_SERIES)
def test_transfer_mode_is_read_where_vllms_factory_reads_it(series: str) -> None:
    # vLLM 0.34's factory reads the key, 0.32's and 0.33's do not (tests/test_push_switch.py
    # asks the installed factory itself).
    reads = series == "0.34"
    assert _parse({TRANSFER_MODE: "push"}, series).transfer_mode == ("push" if reads else "pull")
    if reads:
        with pytest.raises(UnsupportedTransferModeError):
            _parse({TRANSFER_MODE: "write"}, series)
    else:  # 0.32, 0.33: the key means nothing to vLLM's NixlConnector, nor to ours
        assert _parse({TRANSFER_MODE: "write"}, series) == ConnectorOptions()
    # A connector that is push by its class (TraitsNixlPushConnector) reads no such key.
    push = ConnectorOptions.from_extra_config({TRANSFER_MODE: "write"}, series=series, mode="push")
    assert push.transfer_mode == "push"


def test_a_later_series_keeps_transfer_mode_push_a_push_connector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Failure mode (issue 49 item 8): the series that read ``transfer_mode`` were an exact
    set, ``{"0.34"}``, so once a 0.35 was added to the supported list, ``"transfer_mode":
    "push"`` under ``TraitsNixlConnector`` would silently run pull. The quirk compares by
    order: a vLLM 0.35.0 added to the supported series reads the key as 0.34 does."""
    extra = {TRANSFER_MODE: "push"}
    config = cast(
        VllmConfig,
        types.SimpleNamespace(
            kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra)
        ),
    )
    monkeypatch.setattr(_gate, "installed_vllm", lambda: "0.35.0")
    # Not supported yet: the gate refuses it before any key is read.
    with pytest.raises(UnsupportedVllmVersionError, match=r"vLLM 0\.35\.0 is installed"):
        connector_options(config)
    monkeypatch.setattr(_gate, "SUPPORTED_VLLM_SERIES", (*SUPPORTED_VLLM_SERIES, "0.35"))
    assert connector_options(config).transfer_mode == "push"  # TraitsNixlConnector.__new__'s test
    with pytest.raises(UnsupportedTransferModeError):
        connector_options(
            cast(
                VllmConfig,
                types.SimpleNamespace(
                    kv_transfer_config=types.SimpleNamespace(
                        kv_connector_extra_config={TRANSFER_MODE: "write"}
                    )
                ),
            )
        )


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("kvspec_shm_wiat", SHM_WAIT),
        ("kvspec_shmwait", SHM_WAIT),
        ("kvspec_lease_margins", LEASE_MARGIN_KEY),
        ("kvspec_require_trait_peer", REQUIRE_TRAITS_PEER),
        ("kvspec_nixl_progress_delay", NIXL_PROGRESS_DELAY),
        ("kvspec_progress_delay_us", NIXL_PROGRESS_DELAY),
    ],
)
@pytest.mark.parametrize("series", SUPPORTED_VLLM_SERIES)
def test_a_typo_names_the_key_meant(typo: str, meant: str, series: str) -> None:
    with pytest.raises(UnknownConnectorOptionError) as info:
        _parse({SHM_WAIT: "sleep", typo: "sleep"}, series)
    err = info.value
    assert err.key == typo and err.value == "sleep" and err.closest == meant
    assert f"did you mean {meant!r}?" in str(err)
    assert all(key in str(err) for key in OURS)


def test_an_unknown_key_like_none_of_ours_lists_them_all() -> None:
    with pytest.raises(UnknownConnectorOptionError) as info:
        _parse({"kvspec_zzz": 1})
    assert info.value.closest is None and "did you mean" not in str(info.value)
    assert f"Its keys: {', '.join(OURS)}" in str(info.value)


def test_vllms_own_keys_are_left_to_vllm() -> None:
    extra = {
        "backends": ["UCX"],
        "bidirectional_kv_xfer": True,
        "enforce_handshake_compat": False,
        "num_threads": 4,
        "some_future_upstream_key": object(),
    }
    assert _parse(extra) == ConnectorOptions()


def test_options_made_by_hand_are_checked_the_same_way() -> None:
    with pytest.raises(ConnectorOptionError, match=REQUIRE_TRAITS_PEER):
        ConnectorOptions(require_traits_peer=cast(Any, "false"))
    with pytest.raises(LeaseMarginError):
        dataclasses.replace(ConnectorOptions(), lease_margin=-1.0)
    options = ConnectorOptions(lease_margin=1, nixl_progress_delay_us=cast(Any, 50.0))
    assert options.lease_margin == 1.0 and type(options.lease_margin) is float
    assert options.nixl_progress_delay_us == 50 and type(options.nixl_progress_delay_us) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.shm_wait = "sleep"  # type: ignore[misc]
    assert not hasattr(options, "__dict__")  # slotted
    with pytest.raises(TypeError):
        ConnectorOptions("push")  # type: ignore[call-arg]  # keyword-only


def test_the_options_table_in_the_docs_is_the_code() -> None:
    text = (REPO / "docs" / "vllm.md").read_text()
    section = text.split("\n## Options", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| `([^`]+)` \|", section, flags=re.M)
    assert {key: field for key, field, _ in rows} == KEYS
    defaults = ConnectorOptions()
    for key, field, default in rows:
        assert json.loads(default) == getattr(defaults, field), key


def test_importing_the_options_imports_no_vllm() -> None:
    code = (
        "import sys\nimport kvspec_traits.vllm_connector as c\n"
        "assert c.ConnectorOptions().shm_wait == 'yield'\n"
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.stdout.strip() == "[]", proc.stderr[-2000:]


# -- read once, when the connector is built -------------------------------------------


@pytest.fixture(autouse=True)
def _restore_the_flag() -> Iterator[None]:
    """``kvspec_shm_wait`` is process-wide: every test leaves vLLM's flag as it found it."""
    before = vllm_utils.USE_SCHED_YIELD
    yield
    vllm_utils.USE_SCHED_YIELD = before


@pytest.fixture
def agents(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``pthrDelay`` of every NIXL agent built from here on (real agents)."""
    seen: list[int] = []
    native = nixlBind.nixlAgent

    def recording(name: str, config: Any) -> Any:
        seen.append(config.pthrDelay)
        return native(name, config)

    monkeypatch.setattr(nixlBind, "nixlAgent", recording)
    return seen


def _config(tiny_models: pathlib.Path, extra: dict[str, object]) -> VllmConfig:
    config = _vllm_config(tiny_models / LLAMA, LBHNC, None)
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config.update(extra)
    return config


def test_connector_options_reads_a_vllm_config(tiny_models: pathlib.Path) -> None:
    vllm_config = _config(tiny_models, {SHM_WAIT: "sleep", REQUIRE_TRAITS_PEER: True})
    options = connector_options(vllm_config)
    assert options.shm_wait == "sleep" and options.require_traits_peer is True
    assert options.nixl_progress_delay_us == 100  # the tests' configs set it
    assert connector_options(vllm_config, mode="push").transfer_mode == "push"
    vllm_config.kv_transfer_config = None
    assert connector_options(vllm_config) == ConnectorOptions()


CONNECTORS: dict[str, type[Any]] = {"pull": TraitsNixlConnector, "push": TraitsNixlPushConnector}
ROLES = {"scheduler": KVConnectorRole.SCHEDULER, "worker": KVConnectorRole.WORKER}


@pytest.mark.parametrize(
    ("key", "bad", "error"),
    [
        (REQUIRE_TRAITS_PEER, "false", ConnectorOptionError),
        (REQUIRE_TRAITS_PEER, 1, ConnectorOptionError),
        (NIXL_PROGRESS_DELAY, 2 * MAX_DELAY_US, ProgressDelayError),
        (SHM_WAIT, "nap", ShmWaitError),
        (LEASE_MARGIN_KEY, -1, LeaseMarginError),
        ("kvspec_shm_wiat", "sleep", UnknownConnectorOptionError),
    ],
)
@pytest.mark.parametrize("role", sorted(ROLES))
@pytest.mark.parametrize("mode", sorted(CONNECTORS))
def test_a_bad_value_fails_the_construction_before_anything_is_built(
    tiny_models: pathlib.Path,
    agents: list[int],
    mode: str,
    role: str,
    key: str,
    bad: object,
    error: type[Exception],
) -> None:
    """Refused in both roles of both connectors, before a NIXL agent exists and before
    the valid ``kvspec_shm_wait`` beside the bad key changes vLLM's queues."""
    extra: dict[str, object] = {SHM_WAIT: "sleep", key: bad} if key != SHM_WAIT else {key: bad}
    vllm_config = _config(tiny_models, extra)
    kv_cache_config = layouts.kv_cache_config(_gqa(1), 4, LBHNC)
    with set_current_vllm_config(vllm_config), pytest.raises(error) as info:
        CONNECTORS[mode](vllm_config, ROLES[role], kv_cache_config)
    assert isinstance(info.value, ConnectorOptionError) and info.value.key == key
    assert agents == []
    assert vllm_utils.USE_SCHED_YIELD is True


@pytest.mark.parametrize("mode", sorted(CONNECTORS))
def test_transfer_mode_fails_the_construction_where_upstream_reads_it(
    tiny_models: pathlib.Path, mode: str
) -> None:
    """``"write"``: ``TraitsNixlConnector`` refuses it where vLLM's factory refuses it
    for ``NixlConnector``; ``TraitsNixlPushConnector``, push by name as upstream's
    ``NixlPushConnector``, reads no such key."""
    vllm_config = _config(tiny_models, {TRANSFER_MODE: "write"})
    kv_cache_config = layouts.kv_cache_config(_gqa(1), 4, LBHNC)
    upstream_refuses = False
    try:
        _upstream_class({TRANSFER_MODE: "write"})
    except ValueError:
        upstream_refuses = True
    with set_current_vllm_config(vllm_config):
        if mode == "pull" and upstream_refuses:
            with pytest.raises(UnsupportedTransferModeError):
                TraitsNixlConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
            return
        connector: Any = CONNECTORS[mode](vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    try:
        assert connector.options.transfer_mode == mode
    finally:
        connector.shutdown()


def _build_worker_role(
    cls: Callable[..., Any], vllm_config: VllmConfig, kv_cache_config: Any
) -> Any:
    with set_current_vllm_config(vllm_config):
        return _construct(lambda: cls(vllm_config, KVConnectorRole.WORKER, kv_cache_config))


@pytest.mark.parametrize(
    ("called", "extra"),
    [
        ("pull", {}),
        ("push", {}),
        ("pull", {TRANSFER_MODE: "push"}),  # push where vLLM reads the key (0.34)
    ],
)
def test_the_worker_is_handed_the_options_the_connector_read(
    distributed: None,
    tiny_models: pathlib.Path,
    agents: list[int],
    called: str,
    extra: dict[str, object],
) -> None:
    vllm_config = _config(tiny_models, {**extra, NIXL_PROGRESS_DELAY: 130, LEASE_MARGIN_KEY: 0.25})
    kv_cache_config = layouts.kv_cache_config(_gqa(1), 4, LBHNC)
    connector = _build_worker_role(CONNECTORS[called], vllm_config, kv_cache_config)
    try:
        pushes = called == "push" or issubclass(_upstream_class(extra), NixlPushConnector)
        assert type(connector) is CONNECTORS["push" if pushes else "pull"]
        worker = connector.connector_worker
        assert worker.options is connector.options  # one object, handed down
        assert worker.options.transfer_mode == ("push" if pushes else "pull")
        assert agents == [130]  # the worker's agent, under the delay read
        if not pushes:
            assert worker._leases().margin == 0.25  # the pull worker's lease book
    finally:
        connector.shutdown()


@pytest.mark.parametrize("require", [True, False])
def test_the_worker_checks_peers_with_the_option_the_connector_read(
    distributed: None, tiny_models: pathlib.Path, require: bool
) -> None:
    """A peer without a traits fingerprint (upstream's ``NixlConnector``: our own
    payload as upstream's class decodes it) is refused with ``true`` and accepted, as
    upstream accepts it, with ``false``."""
    vllm_config = _config(tiny_models, {REQUIRE_TRAITS_PEER: require})
    family = AGREE["gqa"]
    kv_cache_config = layouts.kv_cache_config(family.groups(1), NB, family.layout)
    caches = layouts.allocate(kv_cache_config, family.layout)
    connector = _build_worker_role(TraitsNixlConnector, vllm_config, kv_cache_config)
    try:
        worker = connector.connector_worker
        assert worker.options.require_traits_peer is require
        with set_current_vllm_config(vllm_config):
            worker.register_kv_caches(caches)
        payload = worker.xfer_handshake_metadata
        peer = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
        assert getattr(peer, "kvspec_traits_fingerprint", None) is None
        if require:
            with pytest.raises(PeerWithoutTraitsError):
                worker.check_remote_fingerprint(peer)
        else:
            worker.check_remote_fingerprint(peer)
    finally:
        connector.shutdown()
