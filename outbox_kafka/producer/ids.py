"""Event ids: UUIDv7, strictly increasing within a process, safe across fork."""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref

#: Random bytes fetched per system call: enough for several hundred ids.
_RANDOM_BLOCK = 4096


class _UUID7:
    """UUIDv7 (RFC 9562): 48-bit millisecond time, then random bits.

    Ids made by one process are strictly increasing: within a millisecond the
    12-bit ``rand_a`` field is used as a counter. The random bits come from
    ``os.urandom`` a block at a time rather than one system call per id; a
    forked child drops the block it inherited, so parent and child never hand
    out the same random bits.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = -1
        self._counter = 0
        self._random = b""
        self._offset = 0
        _generators.add(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._random = b""
        self._offset = 0

    def _next(self) -> int:
        with self._lock:
            ms = time.time_ns() // 1_000_000
            random, offset = self._random, self._offset
            if offset + 10 > len(random):
                random = self._random = os.urandom(_RANDOM_BLOCK)
                offset = 0
            if ms > self._last_ms:
                self._last_ms = ms
                self._counter = int.from_bytes(random[offset : offset + 2], "big") & 0x7FF
                offset += 2
            else:
                self._counter += 1
                if self._counter > 0xFFF:
                    self._last_ms += 1
                    self._counter = 0
                ms = self._last_ms
            counter = self._counter
            tail = int.from_bytes(random[offset : offset + 8], "big") & ((1 << 62) - 1)
            self._offset = offset + 8
        return (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | tail

    def __call__(self) -> uuid.UUID:
        return uuid.UUID(int=self._next())

    def with_text(self) -> tuple[uuid.UUID, str]:
        """A new id and its canonical text form (what ``str()`` gives), made together."""
        value = self._next()
        h = f"{value:032x}"
        return uuid.UUID(int=value), f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_generators: weakref.WeakSet[_UUID7] = weakref.WeakSet()


def _reset_generators_in_child() -> None:
    for generator in list(_generators):
        generator._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_generators_in_child)

uuid7 = _UUID7()
