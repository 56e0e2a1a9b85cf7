"""The Mooncake backend's side channel: a producer serves its handshake record over TCP,
a consumer fetches it (Mooncake's P2P handshake exchanges engine segments, not plans).

One frame per connection: a 4-byte little-endian length, then the record. The reader
bounds the length (:data:`~kvspec_traits.mooncake._wire.MAX_RECORD`) and the time it
waits, so a hostile or dead server costs a named error, not memory or a hang.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Final

from kvspec_traits.mooncake._wire import MAX_RECORD
from kvspec_traits.transfer import MalformedMetadataError

__all__ = ["RecordServer", "fetch_record"]

_LENGTH: Final = struct.Struct("<I")


class RecordServer:
    """Serves ``record`` to every connection on ``(host, port)`` (port 0: a free one,
    see :attr:`port`) from a daemon thread, until :meth:`close`."""

    def __init__(self, record: bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        self._frame = _LENGTH.pack(len(record)) + record
        self._socket = socket.create_server((host, port))
        self._socket.settimeout(0.2)  # how often the thread looks at the stop flag
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="kvspec-record")
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(5.0)
                with contextlib.suppress(OSError):  # a reader that went away
                    conn.sendall(self._frame)

    def close(self) -> None:
        self._stop.set()
        self._socket.close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> RecordServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch_record(host: str, port: int, *, timeout: float = 10.0) -> bytes:
    """The record served at ``(host, port)``; :class:`MalformedMetadataError` for a
    frame longer than a record may be or cut short, ``OSError`` (``TimeoutError``,
    ``ConnectionRefusedError``) when nothing answers in ``timeout`` seconds."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        (length,) = _LENGTH.unpack(_read(sock, _LENGTH.size))
        if length > MAX_RECORD + 64:
            raise MalformedMetadataError(f"implausible record length {length} from {host}:{port}")
        return _read(sock, length)


def _read(sock: socket.socket, count: int) -> bytes:
    chunks, got = [], 0
    while got < count:
        chunk = sock.recv(min(count - got, 1 << 20))
        if not chunk:
            raise MalformedMetadataError(
                f"truncated: the channel closed after {got} of {count} bytes"
            )
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
