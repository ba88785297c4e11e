"""What every fault scenario needs: writers, relay processes, readers, a clock and an audit.

The audit compares the database (every committed event, with its key's
sequence number: the commit order) with everything read back from Kafka, and
counts what the table reports: lost, duplicated, out of order, wrongly marked.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from outbox_kafka import Event, Outbox
from outbox_kafka.demo.embedded import free_port
from tests.relay_support import Record, TopicReader, scalar, wait_until
from tests.reliability.report import Row, record

REPO = Path(__file__).resolve().parent.parent.parent
CLI = str(Path(sys.executable).with_name("outbox-kafka"))


# --------------------------------------------------------------------------- topics


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        future.result(timeout=30)


# --------------------------------------------------------------------------- writers


class Writer:
    """Writes events round-robin over ``keys`` in transactions of ``chunk``, at ``rate``/s.

    Runs in a thread until ``total`` events are committed (or :meth:`stop`).
    A transaction whose commit failed is retried with new events; its ids are
    kept as *uncertain* (a lost connection during COMMIT may or may not have
    committed) for :func:`check_atomic`.

    ``places``: note each event's place in its key's commit order in
    :attr:`places` (see :func:`take_commit_places`; the ``writer_commit_order``
    table must exist), for an audit that orders by commit, not by sequence
    number (retention restarts a key's numbers).
    """

    def __init__(
        self,
        engine: sa.Engine,
        topic: str,
        keys: Sequence[str],
        total: int,
        *,
        rate: float,
        chunk: int = 20,
        outbox: Outbox | None = None,
        places: bool = False,
    ) -> None:
        self.engine = engine
        self.topic = topic
        self.keys = list(keys)
        self.total = total
        self.rate = rate
        self.chunk = chunk
        self.outbox = outbox or Outbox(allow_unknown_types=True)
        self.committed: list[str] = []
        #: With ``places``: each committed event's place in its key's commit order.
        self.places: dict[str, int] = {}
        self.take_places = places
        self.uncertain: list[list[str]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._n = 0
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> Writer:
        self._thread.start()
        return self

    def _events(self, count: int) -> list[Event]:
        events = []
        for _ in range(count):
            key = self.keys[self._n % len(self.keys)]
            events.append(Event(type="chaos.e", key=key, data={"i": self._n}, topic=self.topic))
            self._n += 1
        return events

    def _run(self) -> None:
        started = time.monotonic()
        try:
            while not self._stop.is_set() and len(self.committed) < self.total:
                count = min(self.chunk, self.total - len(self.committed))
                events = self._events(count)
                ids: list[str] = []
                places: list[int] = []
                try:
                    with self.engine.begin() as conn:
                        if self.take_places:
                            places = take_commit_places(conn, [e.key for e in events])
                        ids = [str(i) for i in self.outbox.enqueue_many(conn, events)]
                except sa.exc.DBAPIError as exc:
                    # Connection lost or server gone: the commit may or may not have
                    # happened. Try again with new events after a pause.
                    self.failures.append(type(exc.orig).__name__)
                    if ids:
                        self.uncertain.append(ids)
                    self._stop.wait(0.2)
                    continue
                self.committed.extend(ids)
                self.places.update(zip(ids, places, strict=False))
                # Pace: where the writer should be after this many events.
                due = started + len(self.committed) / self.rate
                self._stop.wait(max(0.0, due - time.monotonic()))
        except BaseException as exc:
            self.error = exc
            raise

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the writer did not finish in {timeout} s")
        if self.error is not None:
            raise AssertionError(f"the writer failed: {self.error!r}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


# --------------------------------------------------------------------------- relay processes


def relay_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra or {})
    return env


class RelayProcess:
    """``outbox-kafka relay`` as a subprocess, with its own metrics port and log file."""

    def __init__(
        self,
        database_url: str,
        bootstrap: str,
        log_dir: Path,
        name: str,
        *extra: str,
        metrics: bool = True,
    ) -> None:
        self.log_path = log_dir / f"{name}.log"
        self.port = free_port() if metrics else None
        self.args = [
            CLI,
            "relay",
            "--database-url",
            database_url,
            "--bootstrap-servers",
            bootstrap,
            "--poll-interval",
            "0.1",
            "--backoff-base",
            "0.05",
            "--backoff-cap",
            "1",
            "--sample-interval",
            "1",
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(self.port or 0),
            *extra,
        ]
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> RelayProcess:
        assert self.process is None or self.process.poll() is not None
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"---- start {self.starts}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=relay_env(),
                cwd=REPO,
            )
        return self

    def wait_started(self, timeout: float = 60) -> None:
        """Wait until this start of the relay has logged ``relay started``. Before that a
        SIGTERM may find Python still importing the package, where no handler is set
        yet and the signal ends the process as it ends any program (nothing is claimed
        by then)."""
        marker = f"---- start {self.starts}\n"
        deadline = time.monotonic() + timeout
        while "relay started" not in self._log_since(marker):
            assert self.alive(), f"{self.log_path.name}: the relay exited while starting"
            assert time.monotonic() < deadline, f"{self.log_path.name}: not started in {timeout} s"
            time.sleep(0.05)

    def _log_since(self, marker: str) -> str:
        return self.log_path.read_text(errors="replace").rpartition(marker)[2]

    def kill(self, *, wait: bool = True) -> None:
        """SIGKILL: no flush, no record, no goodbye. ``wait=False``: the signal only
        (several relays killed within milliseconds); :meth:`wait_killed` then."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        if wait:
            self.wait_killed()

    def wait_killed(self) -> None:
        assert self.process is not None
        code = self.process.wait(30)
        assert code == -signal.SIGKILL, f"relay exited {code} before it was killed"

    def freeze(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait; the exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        return int(self.process.returncode)

    def get(self, path: str, timeout: float = 5) -> tuple[int, str]:
        """An HTTP GET on the relay's metrics port: (status, body); status 0 if no answer."""
        assert self.port is not None
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.port}{path}", timeout=timeout
            ) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    def metric(self, name: str) -> float | None:
        status, body = self.get("/metrics")
        if status != 200:
            return None
        for line in body.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def actions(self, action: str, *, since: int = 0) -> list[dict[str, Any]]:
        """The log records with ``action`` (a relay started with ``--log-format json``),
        from character ``since`` of :meth:`log` on."""
        return log_actions(self.log()[since:], action)


def log_actions(text: str, action: str) -> list[dict[str, Any]]:
    """The JSON log records (``--log-format json``) of ``text`` whose action is ``action``."""
    found = []
    for line in text.splitlines():
        if f'"action": "{action}"' not in line:
            continue
        body = json_body(line)
        if body.get("action") == action:
            found.append(body)
    return found


class ReadinessWatch:
    """Polls a relay's ``/readyz`` in a thread and keeps the sequence of answers it saw."""

    def __init__(self, relay: RelayProcess, interval: float = 0.25) -> None:
        self.relay = relay
        self.interval = interval
        self.seen: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="readyz", daemon=True)

    def start(self) -> ReadinessWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            status, _ = self.relay.get("/readyz", timeout=3)
            if status and (not self.seen or self.seen[-1] != status):
                self.seen.append(status)

    def mark(self) -> int:
        """A position in :attr:`seen`, to look at what came after it."""
        return len(self.seen)

    def wait_for(
        self, status: int, timeout: float, explain: Callable[[], str] | None = None
    ) -> int:
        """Wait until the latest answer *this watch* saw is ``status``; its :meth:`mark`.

        Wait on the watch, not on a probe of one's own: an answer the test saw
        may not be in :attr:`seen` yet, and readiness answers are cached, so
        two clients can disagree for a moment.
        """
        found: list[int] = []

        def latest_is() -> bool:
            position = len(self.seen)
            if position and self.seen[position - 1] == status:
                found.append(position)
                return True
            return False

        wait_until(
            latest_is,
            timeout,
            interval=0.05,
            what=f"/readyz {status} (the watch saw {self.seen})",
            explain=explain,
        )
        return found[-1]

    def since(self, position: int) -> list[int]:
        return self.seen[max(0, position - 1) :]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


# --------------------------------------------------------------------------- recovery


class RecoveryClock:
    """How long after a fault ends every event written before its end is delivered.

    :meth:`fault_ended` notes the database's clock; a thread then waits until
    no pending event was created before that instant.
    """

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.times: list[float] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def fault_ended(self) -> None:
        started = time.monotonic()
        at = scalar(self.engine, "SELECT clock_timestamp()")
        thread = threading.Thread(target=self._wait, args=(at, started), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _wait(self, at: Any, started: float) -> None:
        deadline = started + 900
        while time.monotonic() < deadline:
            try:
                left = scalar(
                    self.engine,
                    "SELECT count(*) FROM outbox WHERE status = 'pending' AND created_at <= :at",
                    at=at,
                )
            except sa.exc.DBAPIError:
                left = -1
            if left == 0:
                with self._lock:
                    self.times.append(time.monotonic() - started)
                return
            time.sleep(0.1)

    def worst(self, timeout: float = 300) -> float | None:
        for thread in self._threads:
            thread.join(timeout)
        with self._lock:
            if len(self.times) < len(self._threads):
                raise AssertionError("events written before a fault were never all delivered")
            return max(self.times) if self.times else None


# --------------------------------------------------------------------------- reading Kafka


class Collector:
    """Everything read from one topic, across broker generations (a restart empties it)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.generations: list[list[Record]] = []
        self._reader: TopicReader | None = None
        self.new_generation()

    def new_generation(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader = TopicReader(self.bootstrap, self.topic, timeout=60)
        self.generations.append(self._reader.records)

    def read(self, seconds: float) -> int:
        assert self._reader is not None
        return self._reader.poll(seconds)

    def catch_up(self, expected_ids: set[str], timeout: float) -> None:
        """Read until every id of ``expected_ids`` was seen, then until quiet."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not expected_ids <= self.ids():
            self.read(0.5)
        self.settle()

    def settle(self, quiet: float = 1.5) -> None:
        while self.read(quiet):
            pass

    def ids(self) -> set[str]:
        return {r.event_id for g in self.generations for r in g if r.event_id}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


# --------------------------------------------------------------------------- the audit


@dataclass
class Audit:
    enqueued: int
    delivered: int
    lost: list[str]
    duplicated: int
    order_violations: list[str]
    #: Copies of one event whose bytes or key are not the stored event's.
    inconsistent_copies: list[str]
    #: Event ids in Kafka that no committed event has.
    phantoms: list[str]
    #: Events the database does not show as delivered at the end.
    not_marked: list[str]
    #: Delivered events whose recorded (partition, offset) holds another message.
    wrong_marks: list[str]
    statuses: dict[str, int] = field(default_factory=dict)
    #: Per lost event: its key, sequence number and status, where it is recorded
    #: as delivered, and what Kafka holds there.
    lost_detail: list[str] = field(default_factory=list)

    def explain(self) -> str:
        return (
            f"enqueued={self.enqueued} delivered={self.delivered} lost={len(self.lost)} "
            f"dup={self.duplicated} order={len(self.order_violations)} "
            f"inconsistent={len(self.inconsistent_copies)} phantoms={len(self.phantoms)} "
            f"not_marked={len(self.not_marked)} wrong_marks={len(self.wrong_marks)} "
            f"statuses={self.statuses}\n"
            f"lost: {self.lost_detail[:10] or self.lost[:5]}\n"
            f"order: {self.order_violations[:5]}\n"
            f"inconsistent: {self.inconsistent_copies[:5]}\nphantoms: {self.phantoms[:5]}\n"
            f"not marked: {self.not_marked[:5]}\nwrong marks: {self.wrong_marks[:5]}"
        )

    def assert_clean(self, *, marks: bool = True, duplicates: bool = False) -> None:
        """Nothing lost, sent twice, reordered, invented or half-recorded.

        ``duplicates``: allowed where the relay is told to prefer at least once
        (``--on-unproven send``) to waiting for what it cannot prove.
        """
        problems = (
            self.lost
            or (not duplicates and self.duplicated)
            or self.order_violations
            or self.inconsistent_copies
            or self.phantoms
            or self.not_marked
            or (marks and self.wrong_marks)
        )
        assert not problems, self.explain()

    def row(self, scenario: str, recover: float | None, note: str = "") -> Row:
        return record(
            Row(
                scenario=scenario,
                enqueued=self.enqueued,
                delivered=self.delivered,
                lost=len(self.lost),
                duplicated=self.duplicated,
                order_violations=len(self.order_violations),
                recover_seconds=recover,
                note=note,
            )
        )


#: Rows retention deletes are kept in ``outbox_purged`` (see :func:`keep_purged`).
KEEP_PURGED = [
    "CREATE TABLE outbox_purged (LIKE outbox)",
    "CREATE FUNCTION outbox_keep_purged() RETURNS trigger LANGUAGE plpgsql AS $$ "
    "BEGIN INSERT INTO outbox_purged SELECT OLD.*; RETURN OLD; END $$",
    "CREATE TRIGGER outbox_keep_purged AFTER DELETE ON outbox "
    "FOR EACH ROW EXECUTE FUNCTION outbox_keep_purged()",
]


def keep_purged(engine: sa.Engine) -> None:
    """Keep every row retention deletes from ``outbox`` in ``outbox_purged``, so that
    ``audit(..., purged=True)`` still sees purged events."""
    with engine.begin() as conn:
        for statement in KEEP_PURGED:
            conn.exec_driver_sql(statement)


def audit(
    engine: sa.Engine,
    generations: Sequence[Sequence[Record]],
    *,
    purged: bool = False,
    places: Mapping[str, int] | None = None,
    discarded: bool = False,
) -> Audit:
    """Compare every committed event with what Kafka holds (all generations, in order).

    ``purged``: the events retention deleted count too (kept by :func:`keep_purged`).
    ``places``: each event's place in its key's commit order (``Writer(places=True)``):
    the order is checked by those, not by sequence numbers, which restart when
    retention deletes a key's counter. ``discarded``: discarded events are expected
    off the topic (neither lost nor unmarked; one found there is unmarked).
    """
    columns = (
        "CAST(event_id AS text), ordering_key, seq, status, kafka_partition, kafka_offset, value"
    )
    source = f"SELECT {columns} FROM outbox"
    if purged:
        source += f" UNION ALL SELECT {columns} FROM outbox_purged"
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"{source} ORDER BY 2, 3")).all()
    events = {r[0]: r for r in rows}
    statuses: dict[str, int] = defaultdict(int)
    for event in rows:
        statuses[event[3]] += 1

    # Kafka order: generation, then partition and offset.
    ordered = [
        rec
        for records in generations
        for rec in sorted(records, key=lambda rec: (rec.partition, rec.offset))
    ]
    copies: dict[str, list[Record]] = defaultdict(list)
    at: set[tuple[int, int, str]] = set()
    held_at: dict[tuple[int, int], list[str]] = defaultdict(list)
    first_seen: dict[str, list[int]] = defaultdict(list)
    phantoms = []
    for rec in ordered:
        event_id = rec.event_id
        at.add((rec.partition, rec.offset, event_id))
        held_at[(rec.partition, rec.offset)].append(event_id or "<no event id>")
        if event_id not in events:
            phantoms.append(event_id or f"<no event id at {rec.partition}/{rec.offset}>")
            continue
        if not copies[event_id]:
            assert rec.key is not None
            first_seen[rec.key].append(int(events[event_id][2]))
        copies[event_id].append(rec)

    inconsistent = []
    for event_id, found in copies.items():
        row = events[event_id]
        for rec in found:
            if rec.raw != bytes(row[6]) or rec.key != row[1]:
                inconsistent.append(event_id)
                break

    violations = []
    if places is not None:
        violations = commit_order_violations(
            [(rec.event_id, rec.key or "") for rec in ordered if rec.event_id in events],
            places,
        )
    else:
        for key, seqs in first_seen.items():
            for before, after in itertools.pairwise(seqs):
                if after <= before:
                    violations.append(f"{key}: seq {after} after {before}")

    expected_off = {i for i, r in events.items() if discarded and r[3] == "discarded"}
    lost = [i for i in events if i not in copies and i not in expected_off]
    lost_detail = [
        f"{i} (key {events[i][1]} seq {events[i][2]}, {events[i][3]}"
        + (
            f" at {events[i][4]}/{events[i][5]}, which holds "
            f"{held_at.get((events[i][4], events[i][5])) or 'nothing read'})"
            if events[i][4] is not None
            else ")"
        )
        for i in lost
    ]
    not_marked = [
        i
        for i, r in events.items()
        if r[3] != "delivered" and (i not in expected_off or i in copies)
    ]
    wrong_marks = [
        i
        for i, r in events.items()
        if r[3] == "delivered" and i in copies and (r[4], r[5], i) not in at
    ]
    return Audit(
        enqueued=len(events),
        delivered=len(copies),
        lost=lost,
        duplicated=sum(len(v) - 1 for v in copies.values()),
        order_violations=violations,
        inconsistent_copies=inconsistent,
        phantoms=phantoms,
        not_marked=not_marked,
        wrong_marks=wrong_marks,
        statuses=dict(statuses),
        lost_detail=lost_detail,
    )


def commit_order_violations(
    delivered: Iterable[tuple[str, str]],
    committed: Mapping[str, int],
    *,
    ignore: Container[str] = (),
) -> list[str]:
    """Where a key's events, by first copy, did not reach a reader in commit order.

    ``delivered`` is (event id, key) of every record in the order a reader of
    one topic sees them (per partition, by offset; a key is on one partition);
    ``committed`` maps each event id to its place in its key's commit order.
    The places must come from the writers (see ``writer_commit_order``), not
    from the outbox's sequence numbers: a key whose counter retention deleted
    numbers its events from 1 again, so sequence numbers order a key's events
    only within one life of its counter. Later copies of an event (duplicates)
    and the events in ``ignore`` are not compared; ids not in ``committed``
    are the phantom check's business.
    """
    last: dict[str, tuple[int, str]] = {}
    seen: set[str] = set()
    violations = []
    for event_id, key in delivered:
        if event_id in seen:
            continue
        seen.add(event_id)
        if event_id in ignore or event_id not in committed:
            continue
        place = committed[event_id]
        before = last.get(key)
        if before is not None and place <= before[0]:
            violations.append(
                f"{key}: {event_id} (commit #{place}) after {before[1]} (commit #{before[0]})"
            )
        last[key] = (place, event_id)
    return violations


#: The writers' own count of each key's committed events (see :func:`take_commit_places`).
WRITER_COMMIT_ORDER = (
    "CREATE TABLE writer_commit_order (ordering_key text PRIMARY KEY, n bigint NOT NULL)"
)


def take_commit_places(conn: sa.Connection, keys: Sequence[str]) -> list[int]:
    """Each of ``keys``' place in its key's commit order, in this transaction.

    ``keys`` are the keys of the events about to be enqueued, in their order.
    Each key's row of ``writer_commit_order`` is counted on and held until the
    commit, in key order (before the outbox's counters, also taken in key
    order: no deadlock), so a key's places follow its transactions' commit
    order, across writers, and are never reset by retention.
    """
    counts: dict[str, int] = defaultdict(int)
    for key in keys:
        counts[key] += 1
    upto = {
        key: int(
            conn.execute(
                sa.text(
                    "INSERT INTO writer_commit_order AS o (ordering_key, n) VALUES (:key, :n) "
                    "ON CONFLICT (ordering_key) DO UPDATE SET n = o.n + EXCLUDED.n RETURNING o.n"
                ),
                {"key": key, "n": n},
            ).scalar_one()
        )
        for key, n in sorted(counts.items())
    }
    places = []
    for key in reversed(keys):
        places.append(upto[key])
        upto[key] -= 1
    return places[::-1]


def check_writer(engine: sa.Engine, writer: Writer, *, purged: bool = False) -> None:
    """Every commit the writer saw succeed is in the outbox; every uncertain one whole or absent.

    ``purged``: the events retention deleted count too (kept by :func:`keep_purged`).
    """
    source = "SELECT CAST(event_id AS text) FROM outbox"
    if purged:
        source += " UNION ALL SELECT CAST(event_id AS text) FROM outbox_purged"
    with engine.connect() as conn:
        present = set(conn.execute(sa.text(source)).scalars())
    missing = [i for i in writer.committed if i not in present]
    assert not missing, f"{len(missing)} committed events are not in the outbox: {missing[:3]}"
    for ids in writer.uncertain:
        found = sum(1 for i in ids if i in present)
        assert found in (0, len(ids)), f"a transaction was half written: {found} of {len(ids)}"


def pending(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'"))


def wait_all_delivered(engine: sa.Engine, timeout: float, explain: Callable[[], str]) -> None:
    wait_until(
        lambda: pending(engine) == 0,
        timeout,
        interval=0.25,
        what="every event delivered",
        explain=explain,
    )


def random_pauses(rng: random.Random, count: int, low: float, high: float) -> list[float]:
    return [rng.uniform(low, high) for _ in range(count)]


def json_body(text: str) -> dict[str, Any]:
    try:
        body = json.loads(text)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
