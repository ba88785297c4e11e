"""How the relay waits between cycles: busy (no wake-ups wanted), or idle, holding
the wake lock so that producers notify it, or polling when it cannot listen."""

from __future__ import annotations

import logging
import threading
import time

from outbox_kafka.errors import StorageError
from outbox_kafka.relay.wakeups import Wakeups

log = logging.getLogger("outbox_kafka.relay")

#: How long a relay about to wait idle waits for producers' transactions that
#: hold the wake lock (they sent no notify) before it waits anyway, briefly.
IDLE_LOCK_WAIT = 0.1
#: An idle relay checks for stop() (and, without the wake lock, tries to take
#: it) at least this often (seconds).
STOP_CHECK = 0.25


class Waiting:
    """Waits between cycles on ``wakeups``, or polls every ``poll_interval`` without it."""

    def __init__(
        self, wakeups: Wakeups | None, poll_interval: float, stopping: threading.Event
    ) -> None:
        self.wakeups = wakeups
        self.poll_interval = poll_interval
        self._stopping = stopping

    def stay_busy(self) -> None:
        """After a cycle that did something: no wake-ups wanted, none left unread.

        Producers stop notifying once the wake lock is let go. The
        notifications sent meanwhile are of no use, but unread they would pin
        the server's notification queue, which every application of the
        cluster shares.
        """
        if self.wakeups is None:
            return
        try:
            self.wakeups.announce_busy()
            self.wakeups.drop_wakeups()
        except StorageError as exc:
            log.warning(
                "could not read notifications", extra={"action": "db_error", "error": str(exc)}
            )

    def idle(self) -> None:
        """After a cycle with nothing to do: wait for a wake-up or ``poll_interval``.

        The first time, announce the relay idle (take the wake lock) and return
        to look for work once more instead of waiting: what producers committed
        before the lock was taken did not notify. When another relay is the
        idle one, its wake-ups reach this relay too; when a producer's long
        transaction holds the lock, wait only briefly before trying again.
        """
        timeout = self.poll_interval
        wakeups = self.wakeups
        if wakeups is None:
            self._stopping.wait(timeout)
            return
        try:
            if not wakeups.idle_announced:
                if wakeups.announce_idle(IDLE_LOCK_WAIT):
                    return
                if not wakeups.another_relay_idle():
                    timeout = min(timeout, IDLE_LOCK_WAIT)
            # In slices, so that stop() is heard within one whatever the poll
            # interval; a relay without the lock tries it again at each, since the
            # relay that holds it may stop or go busy at any time.
            deadline = time.monotonic() + timeout
            while not self._stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or wakeups.wait_for_wakeup(min(left, STOP_CHECK)):
                    break
                if not wakeups.idle_announced and wakeups.announce_idle(0.001):
                    break  # now the idle one: look for work once more
        except StorageError:
            self._stopping.wait(timeout)

    def close(self) -> None:
        if self.wakeups is not None:
            self.wakeups.close()
