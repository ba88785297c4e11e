"""Bounds on each connection to the relay's HTTP endpoint: the limits, a socket reader
that holds a request to its deadline, and a writer whose every write is timed.
See :mod:`outbox_kafka.relay.http_server` for how they are used."""

from __future__ import annotations

import io
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from outbox_kafka.errors import ConfigurationError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer


@dataclass(frozen=True)
class HttpLimits:
    """How long a connection may take and how many are served at once.

    ``idle_timeout``: seconds a connection may stay silent before a request
    starts (a new connection, or a keep-alive one between requests).
    ``request_timeout``: seconds from a request's first byte to the end of its
    headers, so a request sent in dribs is cut off too. ``write_timeout``:
    seconds each write of an answer may take (a client that stops reading is
    dropped). ``max_connections``: connections served at once; more are
    answered 503 and closed at once.
    """

    #: Above the shipped Prometheus scrape interval (5 s), so a scraper keeps
    #: one connection instead of racing the server's close at every scrape.
    idle_timeout: float = 10.0
    request_timeout: float = 5.0
    write_timeout: float = 10.0
    max_connections: int = 16

    def __post_init__(self) -> None:
        for name in ("idle_timeout", "request_timeout", "write_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigurationError(f"HTTP {name} must be above 0 seconds, got {value}")
        if self.max_connections < 1:
            raise ConfigurationError(
                f"HTTP max_connections must be at least 1, got {self.max_connections}"
            )


class DeadlineReader(io.RawIOBase):
    """Reads a socket within a deadline rather than a per-read timeout.

    :meth:`expect_request` gives the next request ``idle_timeout`` seconds to
    begin; its first byte moves the deadline to ``request_timeout`` from then.
    A read past the deadline raises :class:`TimeoutError`, which the request
    handler treats as "close this connection".
    """

    def __init__(
        self,
        sock: socket.socket,
        limits: HttpLimits,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._sock = sock
        self._limits = limits
        self._clock = clock
        self._deadline = clock() + limits.idle_timeout
        self._started = False

    def expect_request(self) -> None:
        """Start waiting for a new request: ``idle_timeout`` from now until its first byte."""
        self._deadline = self._clock() + self._limits.idle_timeout
        self._started = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        remaining = self._deadline - self._clock()
        if remaining <= 0:
            raise TimeoutError(self._overdue())
        self._sock.settimeout(remaining)
        try:
            count = self._sock.recv_into(buffer)
        except TimeoutError:
            raise TimeoutError(self._overdue()) from None
        if count and not self._started:
            self._started = True
            self._deadline = self._clock() + self._limits.request_timeout
        return count

    def _overdue(self) -> str:
        if self._started:
            return f"request not complete within {self._limits.request_timeout:g} s"
        return f"no request within {self._limits.idle_timeout:g} s"


class TimedWriter(io.BufferedIOBase):
    """Writes to a socket, each write bounded by ``timeout`` seconds in total."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        super().__init__()
        self._sock = sock
        self._timeout = timeout

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        view = memoryview(data)
        self._sock.settimeout(self._timeout)
        try:
            self._sock.sendall(view)
        except TimeoutError:
            raise TimeoutError(f"answer not sent within {self._timeout:g} s") from None
        return view.nbytes

    def fileno(self) -> int:
        return self._sock.fileno()
