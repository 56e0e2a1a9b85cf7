"""Two "hosts" on one machine: two network namespaces joined by one veth pair.

Each namespace holds its loopback and one end of the pair (the same device name,
:data:`DEVICE`, in both), with one address of :data:`SUBNET` on it: the only addresses
the test makes, on the only link it makes. Nothing is routed to or from this process's
namespace; a server's HTTP API is reached on its namespace's own 127.0.0.1
(``pd_harness.open_url``), so a fault of the link between the hosts does not touch the
client's path.

Names carry this process's id (``kvspec-e2e-<pid>-<hex>``): :func:`two_hosts` deletes
its namespaces (and with them the veth pair) on every exit path, and first removes the
namespaces of earlier runs whose process is gone (a SIGKILLed run). Everything here
needs root and iproute2 (``ip``, ``ss``); :func:`unavailable` says why not.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from tests.e2e.pd_harness import Host

__all__ = [
    "DEVICE",
    "PREFIX",
    "SUBNET",
    "Listener",
    "TwoHosts",
    "link_bytes",
    "link_state",
    "listeners",
    "set_link",
    "two_hosts",
    "unavailable",
]

PREFIX = "kvspec-e2e-"
DEVICE = "kvlink"
# A /24 of the test's own, on its own veth pair only; the prefill host is .1, decode .2.
SUBNET = "10.47.0"
ADDRESSES = (f"{SUBNET}.1", f"{SUBNET}.2")


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why this process cannot make network namespaces (None: it can): not root, no
    iproute2, or ``ip netns add`` refused (a container without CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); this process is not root"
    missing = [tool for tool in ("ip", "ss") if shutil.which(tool) is None]
    if missing:
        return f"iproute2 is not installed ({', '.join(missing)} missing; scripts/bootstrap.sh)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as err:
        return f"ip netns is not permitted here: {err}"
    _ip("netns", "del", probe)
    return None


@dataclass(frozen=True)
class TwoHosts:
    """The prefill host (``.1``) and the decode host (``.2``) and the link between them."""

    prefill: Host
    decode: Host

    def hosts(self) -> tuple[Host, Host]:
        return self.prefill, self.decode


def _remove_leftovers() -> None:
    """Delete the namespaces of earlier runs whose process no longer runs."""
    for line in _ip("netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@contextmanager
def two_hosts(env: Mapping[str, str] | None = None) -> Iterator[TwoHosts]:
    """Make both namespaces and the link (up, addressed), yield, always delete them.
    ``env``: more environment for a server on either host."""
    _remove_leftovers()
    tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    names = (f"{tag}-p", f"{tag}-d")
    made: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        # Each end created in its namespace at once: no moment with a device in ours.
        _ip(
            "link",
            "add",
            DEVICE,
            "netns",
            names[0],
            "type",
            "veth",
            "peer",
            "name",
            DEVICE,
            "netns",
            names[1],
        )
        for name, address in zip(names, ADDRESSES, strict=True):
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", DEVICE)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", DEVICE, "up")
        prefill, decode = (
            Host(netns=name, address=address, env=dict(env or {}))
            for name, address in zip(names, ADDRESSES, strict=True)
        )
        yield TwoHosts(prefill=prefill, decode=decode)
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def set_link(hosts: TwoHosts, up: bool, settle_s: float = 5.0) -> tuple[str, str]:
    """Set the prefill host's end of the link up or down, from this (the root)
    namespace, and return both ends' operational states once they show it (the kernel
    reports a carrier change a moment later; at most ``settle_s``): ``("UP", "UP")``, or
    ``("DOWN", "DOWN")`` (a downed end's peer loses its carrier: DOWN too)."""
    _ip("-n", hosts.prefill.netns, "link", "set", DEVICE, "up" if up else "down")
    expected = ("UP", "UP") if up else ("DOWN", "DOWN")
    deadline = time.monotonic() + settle_s
    while True:
        states = (link_state(hosts.prefill), link_state(hosts.decode))
        if states == expected or time.monotonic() > deadline:
            return states
        time.sleep(0.05)


def link_state(host: Host) -> str:
    """The operational state of ``host``'s end of the link (``ip -j link show``)."""
    (info,) = json.loads(_ip("-n", host.netns, "-j", "link", "show", DEVICE))
    return str(info["operstate"])


def link_bytes(host: Host) -> tuple[int, int]:
    """``(sent, received)`` bytes of ``host``'s end of the link so far."""
    (info,) = json.loads(_ip("-n", host.netns, "-s", "-j", "link", "show", DEVICE))
    stats = info["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket: its local address, port and owning process's command."""

    address: str
    port: int
    process: str

    def __str__(self) -> str:
        return f"{self.address}:{self.port} ({self.process})"


def listeners(host: Host) -> list[Listener]:
    """Every TCP socket listening in ``host``'s namespace (``ss -Hltnp`` run there)."""
    done = subprocess.run(
        ["ip", "netns", "exec", host.netns, "ss", "-Hltnp"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    found = []
    for line in done.stdout.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        address, _, port = fields[3].rpartition(":")
        users = fields[5] if len(fields) > 5 else ""
        process = users.split('"')[1] if '"' in users else users
        found.append(Listener(address.strip("[]"), int(port), process))
    return found
