"""Wake-ups: the relay's LISTEN connection, and the wake lock an idle relay holds
so that producers notify it (see ``announce_idle`` in ``sql/queries.sql``).

One dedicated autocommit connection, outside the pool, lives as long as the relay.
"""

from __future__ import annotations

import contextlib
import select
import time
from collections.abc import Iterator

import psycopg2
import psycopg2.errors
import psycopg2.extensions
from sqlalchemy import Engine

from outbox_kafka.database import storage_errors
from outbox_kafka.errors import StorageError
from outbox_kafka.naming import TableNames
from outbox_kafka.queries import millis, queries_for


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
