"""Wake-ups: how the relay waits between cycles, and the LISTEN connection it waits on.

:class:`Waiting`: busy (no wake-ups wanted), or idle, holding the wake lock so
that producers notify it, or polling when it cannot listen.

:class:`Wakeups`: the relay's LISTEN connection, and the wake lock an idle relay
holds so that producers notify it (see ``announce_idle`` in ``sql/queries.sql``).
One dedicated autocommit connection, outside the pool, lives as long as the relay.
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections.abc import Iterator

import psycopg2
import psycopg2.errors
import psycopg2.extensions
from sqlalchemy import Engine

from outbox_kafka.database import storage_errors
from outbox_kafka.errors import StorageError
from outbox_kafka.naming import TableNames
from outbox_kafka.schema.statements import millis, queries_for


class Wakeups:
    """The LISTEN connection of one outbox, opened on first use from ``engine``."""

    def __init__(self, engine: Engine, names: TableNames) -> None:
        self.names = names
        self._engine = engine
        self._q = queries_for(names)
        self._listener: psycopg2.extensions.connection | None = None
        self._idle = False
        self._wake_lock = {"wake_lock": names.wake_lock}

    def _listen(self) -> psycopg2.extensions.connection:
        if self._listener is None or self._listener.closed:
            raw = self._engine.raw_connection()
            try:
                dbapi = raw.driver_connection
                assert isinstance(dbapi, psycopg2.extensions.connection)
                # Detach from the pool: this connection lives as long as the relay.
                raw.detach()
                dbapi.autocommit = True
                with dbapi.cursor() as cur:
                    cur.execute(f"LISTEN {self.names.placeholders()['channel']}")
            except BaseException:
                raw.close()
                raise
            self._listener = dbapi
        return self._listener

    @contextlib.contextmanager
    def _on_listener(self, what: str) -> Iterator[psycopg2.extensions.connection]:
        """The LISTEN connection (opened if need be) for one step.

        A step that fails drops the connection, and with it the wake lock it
        may hold: the next step starts on a new session.
        """
        try:
            with storage_errors(what):
                yield self._listen()
        except (StorageError, OSError):
            self._drop_listener()
            raise

    def wait_for_wakeup(self, timeout: float) -> bool:
        """Block until an enqueue commits (True) or ``timeout`` seconds pass (False)."""
        with self._on_listener("listening for new events") as conn:
            if conn.notifies:
                conn.notifies.clear()
                return True
            ready, _, _ = select.select([conn], [], [], timeout)
            if ready:
                conn.poll()
                woke = bool(conn.notifies)
                conn.notifies.clear()
                return woke
            return False

    def drop_wakeups(self) -> None:
        """Read and forget the notifications that have arrived, without waiting.

        A listening session that is not read holds the server's notification
        queue (shared by the whole cluster) at its position: the relay calls
        this in every busy cycle. Nothing to do before the first LISTEN.
        """
        if self._listener is None or self._listener.closed:
            return
        with self._on_listener("reading notifications") as conn:
            # Whatever the socket holds now, read in a few gulps at most.
            deadline = time.monotonic() + 0.05
            while True:
                conn.poll()
                conn.notifies.clear()
                ready, _, _ = select.select([conn], [], [], 0)
                if not ready or time.monotonic() > deadline:
                    break

    # The wake lock: held while this relay waits idle, so that producers notify.

    @property
    def idle_announced(self) -> bool:
        """Whether this relay holds the wake lock (producers notify it)."""
        return self._idle and self._listener is not None and not self._listener.closed

    def announce_idle(self, wait: float) -> bool:
        """Take the wake lock, waiting up to ``wait`` seconds; whether it is held now.

        Producers that committed meanwhile without a notify held the lock
        shared, so once this returns True every event they wrote is visible:
        look for work once more before waiting for a notification. False when
        another relay holds the lock or a producer's transaction outlasted
        ``wait``; producers then notify only if another relay holds it.
        """
        if self.idle_announced:
            return True
        with self._on_listener("announcing an idle relay") as conn, conn.cursor() as cur:
            cur.execute(self._q.driver_sql("wake_lock_timeout"), {"milliseconds": millis(wait)})
            try:
                cur.execute(self._q.driver_sql("announce_idle"), self._wake_lock)
            except psycopg2.errors.LockNotAvailable:
                return False
        self._idle = True
        return True

    def announce_busy(self) -> None:
        """Let go of the wake lock, if held: producers stop notifying."""
        if not self.idle_announced:
            self._idle = False
            return
        with self._on_listener("announcing a busy relay") as conn, conn.cursor() as cur:
            cur.execute(self._q.driver_sql("announce_busy"), self._wake_lock)
        self._idle = False

    def another_relay_idle(self) -> bool:
        """Whether another relay holds the wake lock (and so producers notify)."""
        lock_id = self._wake_lock["wake_lock"]
        params = {"lock_high": (lock_id >> 32) & 0xFFFFFFFF, "lock_low": lock_id & 0xFFFFFFFF}
        with self._on_listener("looking for an idle relay") as conn, conn.cursor() as cur:
            cur.execute(self._q.driver_sql("wake_lock_held_by_relay"), params)
            row = cur.fetchone()
        return bool(row and row[0])

    def _drop_listener(self) -> None:
        self._idle = False  # the lock goes with the session
        if self._listener is not None:
            with contextlib.suppress(Exception):
                self._listener.close()
            self._listener = None

    def close(self) -> None:
        self._drop_listener()


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
