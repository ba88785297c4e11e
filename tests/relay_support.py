"""Helpers for the relay tests: settings, a Kafka reader, murmur2, a TCP proxy, relay threads.

Nothing here imports the relay's internals beyond its public classes: the
reader is a plain confluent-kafka consumer, murmur2 is written out from
Kafka's Java implementation, and the proxy is a socket pump.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, TopicPartition
from sqlalchemy.engine import make_url

from outbox_kafka import Event, Outbox
from outbox_kafka.naming import TableNames
from outbox_kafka.relay import Relay
from outbox_kafka.relay.batch import RecordResult
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.observe import RelayObserver
from outbox_kafka.schema.statements import queries_for

# --------------------------------------------------------------------------- settings


def make_settings(database_url: str, bootstrap: str, **overrides: Any) -> RelaySettings:
    """Relay settings tuned for tests: short leases, timeouts and backoffs."""
    values: dict[str, Any] = {
        "lease_seconds": 5.0,
        "delivery_timeout_ms": 3000,
        "poll_interval": 0.1,
        "backoff_base": 0.05,
        "backoff_cap": 0.5,
        "shutdown_timeout": 10.0,
    }
    values.update(overrides)
    return RelaySettings(database_url=database_url, bootstrap_servers=bootstrap, **values)


# --------------------------------------------------------------------------- events


class FailingCall:
    """``call`` passed through, except its ``nth`` call, which raises ``error``: a bug
    in a step of the relay, as a loop meets it. ``calls`` counts the calls."""

    def __init__(self, call: Callable[..., Any], nth: int, error: Exception) -> None:
        self.call = call
        self.nth = nth
        self.error = error
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.nth:
            raise self.error
        return self.call(*args, **kwargs)


def topic_outbox(**kwargs: Any) -> Outbox:
    """An outbox without schemas: any type, topic given per event."""
    return Outbox(allow_unknown_types=True, **kwargs)


def enqueue_bulk(
    engine: sa.Engine,
    outbox: Outbox,
    events: Sequence[Event],
    *,
    chunk: int = 1000,
) -> list[str]:
    """Write ``events`` in transactions of ``chunk`` events; return their ids as text."""
    ids: list[str] = []
    for start in range(0, len(events), chunk):
        with engine.begin() as conn:
            ids.extend(str(i) for i in outbox.enqueue_many(conn, events[start : start + chunk]))
    return ids


def admit_arrivals(engine: sa.Engine, names: TableNames | None = None) -> None:
    """Move every key producers queued into the relay's key queue, as a claim does first.

    For tests that set up a key's queue row by hand right after an enqueue.
    """
    with engine.begin() as conn:
        conn.execute(
            queries_for(names or TableNames())["admit_arrivals"],
            {"after_key": "", "admit_limit": 10**9},
        )


def seq_events(topic: str, keys: Sequence[str], count: int, *, type: str = "t.e") -> list[Event]:
    """``count`` events spread round-robin over ``keys``; data carries a per-key ``n``."""
    per_key: dict[str, int] = {}
    events = []
    for i in range(count):
        key = keys[i % len(keys)]
        n = per_key.get(key, 0)
        per_key[key] = n + 1
        events.append(Event(type=type, key=key, data={"n": n, "i": i}, topic=topic))
    return events


# --------------------------------------------------------------------------- reading Kafka


@dataclass(frozen=True)
class Record:
    key: str | None
    key_bytes: bytes | None
    value: Any
    raw: bytes
    headers: dict[str, bytes]
    header_list: list[tuple[str, bytes]]
    partition: int
    offset: int

    @property
    def event_id(self) -> str:
        """The event's id: a dead-letter copy's ``outbox_event_id`` header, the envelope's
        ``id`` in structured mode, the ``ce_id`` header in binary mode; empty when the
        message has none of them."""
        copied = self.headers.get("outbox_event_id")
        if copied is not None:
            return copied.decode()
        if self.headers.get("content-type", b"").startswith(b"application/cloudevents"):
            found = self.value.get("id") if isinstance(self.value, dict) else None
            return found if isinstance(found, str) else ""
        return self.headers.get("ce_id", b"").decode()


def _partitions(consumer: Consumer, topic: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        meta = consumer.list_topics(topic, timeout=max(1.0, deadline - time.monotonic()))
        t = meta.topics.get(topic)
        if t is not None and t.error is None and t.partitions:
            return sorted(t.partitions)
        if time.monotonic() > deadline:
            raise AssertionError(f"topic {topic} has no partitions in the metadata")
        time.sleep(0.2)


def _to_record(msg: Any) -> Record:
    raw: bytes = msg.value() or b""
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = None
    header_list = [(n, v if v is not None else b"") for n, v in (msg.headers() or [])]
    key = msg.key()
    return Record(
        key=key.decode() if key is not None else None,
        key_bytes=key,
        value=value,
        raw=raw,
        headers=dict(header_list),
        header_list=header_list,
        partition=msg.partition(),
        offset=msg.offset(),
    )


class TopicReader:
    """Reads a topic from the beginning of every partition, incrementally.

    The test broker can make a record batch readable after a later one of the same
    partition (two producers appending at once): a consumer that fetched the later
    one has moved past the earlier one and never returns to it. The reader keeps,
    per partition, the first offset it has not read; when it has read past a gap
    it goes back to the gap, and skips what it has read already. A gap never closes
    on a broker that leaves offsets out (compaction, transaction markers): none of
    the topics these tests read has either.
    """

    def __init__(self, bootstrap: str, topic: str, *, timeout: float = 30.0) -> None:
        self.topic = topic
        self.records: list[Record] = []
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"test-{uuid.uuid4().hex}",
                "enable.auto.commit": "false",
                "auto.offset.reset": "earliest",
                "fetch.message.max.bytes": str(8 * 1024 * 1024),
            }
        )
        self.partitions = _partitions(self._consumer, topic, timeout)
        # Offset 0, not OFFSET_BEGINNING: every topic a test reads starts at 0,
        # and the logical offset costs a ListOffsets request whose answer a
        # Kafka-protocol broker may get wrong. The test broker answers
        # "earliest" with the batch written first, not the lowest offset; when
        # concurrent producers' batches land out of offset order, it names a
        # later batch and the earlier ones would never be read. (Were 0 out
        # of range, auto.offset.reset still falls back to the earliest offset.)
        self._consumer.assign([TopicPartition(topic, p, 0) for p in self.partitions])
        #: Per partition: the offsets read past the first one not read yet (empty
        #: while the reader has no gap), and that first unread offset.
        self._read: dict[int, set[int]] = {p: set() for p in self.partitions}
        self._first_unread: dict[int, int] = dict.fromkeys(self.partitions, 0)
        #: Records read again after going back to a gap (and skipped).
        self.reread = 0
        #: Times the reader went back to a gap.
        self.gaps = 0

    def poll(self, seconds: float) -> int:
        """Read for up to ``seconds``; return how many records arrived."""
        deadline = time.monotonic() + seconds
        got = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return got
            batch = self._consumer.consume(num_messages=10_000, timeout=min(left, 0.5))
            for msg in batch:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise AssertionError(f"consumer error: {err}")
                if not self._take(msg.partition(), msg.offset()):
                    self.reread += 1
                    continue
                self.records.append(_to_record(msg))
                got += 1
            self._back_to_gaps()

    def _take(self, partition: int, offset: int) -> bool:
        """Note ``offset`` of ``partition`` as read; False if it was read before."""
        first = self._first_unread.get(partition, 0)
        beyond = self._read.setdefault(partition, set())
        if offset < first or offset in beyond:
            return False
        beyond.add(offset)
        while first in beyond:  # only offsets past the first unread one are kept
            beyond.discard(first)
            first += 1
        self._first_unread[partition] = first
        return True

    def _back_to_gaps(self) -> None:
        """Go back to the first unread offset of each partition read past it."""
        for partition, read in self._read.items():
            if read:  # offsets read beyond one not read yet
                self.gaps += 1
                first = self._first_unread[partition]
                self._consumer.seek(TopicPartition(self.topic, partition, first))

    def until(self, expected: int, timeout: float) -> list[Record]:
        """Read until ``expected`` distinct event ids have arrived, or ``timeout`` runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self.distinct_ids()) < expected:
            self.poll(min(0.5, max(0.0, deadline - time.monotonic())))
        return self.records

    def settle(self, seconds: float = 1.0) -> list[Record]:
        """Keep reading until nothing new arrives for ``seconds``."""
        while self.poll(seconds):
            pass
        return self.records

    def distinct_ids(self) -> set[str]:
        return {r.event_id for r in self.records if r.event_id}

    def close(self) -> None:
        self._consumer.close()


def consume_all(bootstrap: str, topic: str, expected: int, timeout: float = 60.0) -> list[Record]:
    """Every record of ``topic``: waits for ``expected`` distinct event ids, then for quiet.

    The quiet period catches duplicates and extra messages beyond ``expected``.
    """
    reader = TopicReader(bootstrap, topic)
    try:
        reader.until(expected, timeout)
        reader.settle(1.0)
        return list(reader.records)
    finally:
        reader.close()


# --------------------------------------------------------------------------- murmur2


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2`` (Java), as a signed 32-bit int."""
    mask = 0xFFFFFFFF
    m = 0x5BD1E995
    r = 24
    length = len(data)
    h = (0x9747B28C ^ length) & mask
    full = length - length % 4
    for i in range(0, full, 4):
        k = data[i] | data[i + 1] << 8 | data[i + 2] << 16 | data[i + 3] << 24
        k = (k * m) & mask
        k ^= k >> r
        k = (k * m) & mask
        h = (h * m) & mask
        h ^= k
    rest = length % 4
    if rest == 3:
        h ^= data[full + 2] << 16
    if rest >= 2:
        h ^= data[full + 1] << 8
    if rest >= 1:
        h ^= data[full]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def kafka_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner picks for a non-null key."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


# --------------------------------------------------------------------------- TCP proxy


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``target``; :meth:`cut` drops everything until restored,
    :meth:`hang` stops answering without closing anything.

    :meth:`set_delay` holds every byte coming back from the target for that many
    seconds before passing it on (requests still go through at once): a slow
    broker, as its clients see it.
    """

    def __init__(
        self,
        target_port: int,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        target_socket: str | None = None,
    ) -> None:
        """``target_socket``: the path of a Unix socket to forward to instead of a port."""
        self.target = (host, target_port)
        self.target_socket = target_socket
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._cut = threading.Event()
        self._hung = threading.Event()
        #: Clients accepted while hung, held open and never answered.
        self._held: list[socket.socket] = []
        self._closed = threading.Event()
        self.connections = 0
        #: Connections that sent something while hung (left unread and unanswered).
        self.stalled = 0
        self.delay = 0.0
        self._thread = threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True)

    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    def set_target(self, target_port: int) -> None:
        self.target = (self.target[0], target_port)

    @property
    def is_cut(self) -> bool:
        return self._cut.is_set()

    def cut(self) -> None:
        """Close every connection and refuse (accept-and-close) new ones."""
        self._cut.set()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for a, b in pairs:
            _close(a)
            _close(b)

    def hang(self) -> None:
        """Stop answering, as a frozen host or a network dropping packets does: every
        connection stays open and nothing passes either way; new ones are accepted
        and never answered. :meth:`restore` closes them all."""
        self._hung.set()

    def restore(self) -> None:
        if self._hung.is_set():
            self.cut()  # what was held open comes back reset, as after a frozen host
            with self._lock:
                held, self._held = self._held, []
                self._hung.clear()
            for sock in held:
                _close(sock)
        self._cut.clear()

    def set_delay(self, seconds: float) -> None:
        """Delay what the target sends back by ``seconds`` (0: no delay), from now on."""
        self.delay = seconds

    def close(self) -> None:
        self._closed.set()
        self.restore()
        self.cut()
        self._thread.join(5)
        _close(self._listener)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._cut.is_set():
                _close(client)
                continue
            with self._lock:
                if self._hung.is_set():  # under the lock restore() empties the held under
                    self._held.append(client)
                    continue
            try:
                upstream = self._connect_upstream()
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                if self._cut.is_set():
                    _close(client)
                    _close(upstream)
                    continue
                self._pairs.append((client, upstream))
                self.connections += 1
            threading.Thread(
                target=self._pump, args=(client, upstream), name="proxy-pump", daemon=True
            ).start()

    def _connect_upstream(self) -> socket.socket:
        if self.target_socket is None:
            return socket.create_connection(self.target, timeout=5)
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.settimeout(5)
        try:
            upstream.connect(self.target_socket)
        except OSError:
            upstream.close()
            raise
        return upstream

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        """Copy bytes both ways; what ``b`` (the target) sends waits out :attr:`delay`."""
        peers = {a: b, b: a}
        held: collections.deque[tuple[float, bytes]] = collections.deque()
        stalled = False
        try:
            while not self._cut.is_set():
                if self._hung.is_set():
                    waiting, _, _ = select.select([a], [], [], 0.05)
                    if waiting and not stalled:
                        stalled = True
                        with self._lock:
                            self.stalled += 1
                    time.sleep(0.05)
                    continue
                wait = 0.2 if not held else max(0.0, min(0.2, held[0][0] - time.monotonic()))
                ready, _, _ = select.select([a, b], [], [], wait)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is b and (self.delay > 0 or held):
                        held.append((time.monotonic() + self.delay, data))
                    else:
                        peers[sock].sendall(data)
                while held and held[0][0] <= time.monotonic():
                    a.sendall(held.popleft()[1])
        except (OSError, ValueError):
            return
        finally:
            _close(a)
            _close(b)
            with self._lock, contextlib.suppress(ValueError):
                self._pairs.remove((a, b))


def database_proxy(database_url: str) -> tuple[TcpProxy, str]:
    """A started :class:`TcpProxy` in front of the server of ``database_url`` (on a
    port, or a Unix socket as the embedded server's), and the URL through it."""
    url = make_url(database_url)
    socket_dir = url.query.get("host")
    if url.port is None and isinstance(socket_dir, str) and socket_dir.startswith("/"):
        path = f"{socket_dir}/.s.PGSQL.5432"
        proxy = TcpProxy(0, target_socket=path).start()
        url = url.difference_update_query(["host"])
    else:
        proxy = TcpProxy(url.port or 5432, host=url.host or "127.0.0.1").start()
    through = url.set(host="127.0.0.1", port=proxy.port)
    return proxy, through.render_as_string(hide_password=False)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


# --------------------------------------------------------------------------- relay threads


class RecordCounter(RelayObserver):
    """Counts what a relay announces it recorded: batches, and their events and keys."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: Batches recorded (in the loop or in the background), releases included.
        self.batches = 0
        self.totals: collections.Counter[str] = collections.Counter()

    def recorded(self, result: RecordResult, seconds: float) -> None:
        with self.lock:
            self.batches += 1
            self.totals.update(
                delivered=result.delivered,
                retried=result.retried,
                discarded=result.discarded,
                keys_removed=result.keys_removed,
            )

    def lease_lost(self, keys: int) -> None:
        with self.lock:
            self.totals["leases_lost"] += keys


class RelayThread:
    """``Relay.run()`` in a thread; remembers an exception that killed it, and counts
    what the relay recorded (see :class:`RecordCounter`)."""

    def __init__(self, relay: Relay, name: str = "relay") -> None:
        self.relay = relay
        self.error: BaseException | None = None
        self.counter = RecordCounter()
        relay.observer.observers.append(self.counter)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            self.relay.run()
        except BaseException as exc:
            self.error = exc
            raise

    def start(self) -> RelayThread:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        self.relay.stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError("the relay thread did not stop in time")

    @property
    def cycles(self) -> int:
        """Batches recorded so far."""
        return self.counter.batches

    def total(self, field: str) -> int:
        """The sum of ``field`` (delivered, retried, discarded, keys_removed, leases_lost)
        over the batches recorded so far."""
        with self.counter.lock:
            return self.counter.totals[field]


@contextlib.contextmanager
def running_relay(relay: Relay, name: str = "relay") -> Iterator[RelayThread]:
    thread = RelayThread(relay, name).start()
    try:
        yield thread
    finally:
        if thread.is_alive():
            thread.stop()


# --------------------------------------------------------------------------- database views


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(sql), params).all())


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    *,
    interval: float = 0.2,
    what: str = "",
    explain: Callable[[], str] | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            detail = f"\n{explain()}" if explain is not None else ""
            raise AssertionError(
                f"timed out after {timeout} s waiting for {what or condition}{detail}"
            )
        time.sleep(interval)


def outbox_summary(engine: sa.Engine) -> str:
    """Events by status, attempts and error, for failure messages."""
    found = rows(
        engine,
        "SELECT status, attempts > 0 AS retried, left(last_error, 160) AS error, "
        "count(*) AS n FROM outbox GROUP BY 1, 2, 3 ORDER BY 4 DESC LIMIT 12",
    )
    return "\n".join(f"  {r.n:6d} {r.status:9s} retried={r.retried} {r.error}" for r in found)


def delivered_count(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'delivered'"))


def delivered_positions_problem(engine: sa.Engine) -> str | None:
    """Delivered events recorded at the same (partition, offset), if any.

    Kafka gives every acknowledged message an offset of its own, so two events
    recorded at one position mean the relay matched a delivery report to the
    wrong event, or the broker stored two messages at one offset.
    """
    found = rows(
        engine,
        "SELECT topic, kafka_partition, kafka_offset, count(*) AS n FROM outbox "
        "WHERE status = 'delivered' GROUP BY 1, 2, 3 HAVING count(*) > 1 "
        "ORDER BY 2, 3 LIMIT 10",
    )
    if not found:
        return None
    return "several delivered events are recorded at one position: " + ", ".join(
        f"{r.topic}[{r.kafka_partition}]@{r.kafka_offset} x{r.n}" for r in found
    )


def missing_from_topic(engine: sa.Engine, records: Sequence[Record]) -> str:
    """Why delivered events are not among ``records``: where the relay recorded them
    and what the topic holds at those positions. For failure messages."""
    by_position = {(r.partition, r.offset): r for r in records}
    read = {r.event_id for r in records if r.event_id}
    delivered = rows(
        engine,
        "SELECT event_id::text AS id, ordering_key, seq, attempts, kafka_partition, "
        "kafka_offset FROM outbox WHERE status = 'delivered' ORDER BY 5, 6",
    )
    missing = [r for r in delivered if r.id not in read]
    lines = [f"{len(missing)} delivered events are not in the topic ({len(records)} records read)"]
    for r in missing[:12]:
        there = by_position.get((r.kafka_partition, r.kafka_offset))
        holds = "nothing" if there is None else f"{there.event_id} (key {there.key})"
        lines.append(
            f"  {r.id} key {r.ordering_key} seq {r.seq} attempts {r.attempts}: recorded at "
            f"[{r.kafka_partition}]@{r.kafka_offset}, the topic holds {holds} there"
        )
    offsets_by_partition: dict[int, list[int]] = collections.defaultdict(list)
    for rec in records:
        offsets_by_partition[rec.partition].append(rec.offset)
    for partition, offsets in sorted(offsets_by_partition.items()):
        offsets.sort()
        gaps = sum(1 for a, b in itertools.pairwise(offsets) if b != a + 1)
        lines.append(
            f"  partition {partition}: {len(offsets)} records, offsets "
            f"{offsets[0]}..{offsets[-1]}, {gaps} gaps"
        )
    problem = delivered_positions_problem(engine)
    if problem is not None:
        lines.append(f"  {problem}")
    return "\n".join(lines)


def claimed_count(engine: sa.Engine) -> int:
    """Keys a relay holds a claim on right now."""
    return int(scalar(engine, "SELECT count(*) FROM outbox_keys WHERE claim_token IS NOT NULL"))


def discarded_count(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'discarded'"))


def first_occurrences(records: Sequence[Record]) -> list[Record]:
    """Records in consumption order with repeats of an already seen event id dropped."""
    seen: set[str] = set()
    out = []
    for r in records:
        if r.event_id not in seen:
            seen.add(r.event_id)
            out.append(r)
    return out


def by_partition_offset(records: Sequence[Record]) -> list[Record]:
    return sorted(records, key=lambda r: (r.partition, r.offset))


def per_key_order(records: Sequence[Record]) -> dict[str, list[str]]:
    """Event ids per key in Kafka order (partition, offset), first occurrence of each."""
    order: dict[str, list[str]] = {}
    for r in first_occurrences(by_partition_offset(records)):
        assert r.key is not None
        order.setdefault(r.key, []).append(r.event_id)
    return order


def migrate_to(engine: sa.Engine, names: TableNames, version: int) -> None:
    """Bring a new outbox up to ``version`` only, as an older release left it."""
    q = queries_for(names)
    with engine.begin() as conn:
        conn.execute(q["create_versions_table"])
        applied = q.migrations()[:version]
        assert [m.version for m in applied] == list(range(1, version + 1))
        for migration in applied:
            conn.execute(sa.text(migration.sql))
            conn.execute(
                q["record_version"], {"version": migration.version, "name": migration.name}
            )


#: For a broker that validates records (the ``validating_broker`` fixture): refuses a
#: record whose envelope's data says {"poison": true}.
NO_POISON = (
    '{"type": "object", "properties": {"value": {"not": {"type": "object", "required": '
    '["data"], "properties": {"data": {"type": "object", "required": ["poison"]}}}}}}'
)
