"""Our relay against two other Python outbox libraries, on the same database server and broker.

The peers are ``faststream-outbox`` and ``omni-box`` from PyPI. Both need
Python 3.12 or newer, so they run in a virtualenv of their own, made once
with such an interpreter and kept in the user's cache
(:func:`peer_environment`); their publishers and their fills are the scripts
in :mod:`bench.peer_apps`, run as separate processes. Our relay is one
``outbox-kafka relay`` process (run mode, every setting at its default).

Three shapes, each run the same way for the three systems: a fresh database,
a fresh topic of :data:`~bench.broker.PARTITIONS` partitions, the outbox
filled (untimed) through the system's own write API with the same events
(:func:`workload`: event ``i`` on key ``customer-<i mod K>`` with per-key
sequence number ``i // K + 1``, both in its ~500-byte JSON payload), then one
publisher process started while a consumer of our own reads the topic:

* ``start-up``: :data:`SHAPES` ``startup`` events over 200 keys, clocked from
  the publisher's process start until the consumer has read every event;
* ``steady``: 100,000 events over 200 keys, clocked from the publisher's first
  record (the earliest Kafka timestamp on the topic: the producer's CreateTime,
  taken when the publisher hands the record to its producer) until the consumer
  has read every event, so start-up is excluded;
* ``hot keys``: 2,000 events on 4 keys, clocked as ``steady``.

Both clocks are the machine's wall clock (the consumer's read times, the
records' timestamps). Rates count distinct events.

The consumer (confluent-kafka, ``assign()`` of every partition from offset 0:
the embedded broker's consumer groups are slow and its ListOffsets cannot be
relied on, so it counts what it reads) checks every event: ids never read
(lost, or still in the outbox when the run ended), ids read more than once,
and per key the events read after a later one of the same key (first
occurrences only, in partition order). It also checks that each record's
Kafka key is the event's key and that the key's partition is the one Kafka's
Java client (murmur2) would choose.

A publisher that has not delivered everything within :data:`BUDGET_SECONDS`
(or delivers nothing new for :data:`STALL_SECONDS`) is stopped; its figure is
then the rate over what it delivered, and the row says so.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Consumer, TopicPartition
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from outbox_kafka import Event, Outbox
from outbox_kafka.relay.recover import key_partition

from .broker import PARTITIONS, Kafka
from .common import BenchContext, Result, Target, load_average, paired_ratios
from .processes import RelayProcess
from .tables import FILL_BATCH, Table

NAME = "peers"
#: The systems, in the order each round runs them; ours first.
OURS = "outbox-kafka"
FASTSTREAM = "faststream-outbox"
OMNIBOX = "omni-box"
PEERS = (FASTSTREAM, OMNIBOX)
SYSTEMS = (OURS, *PEERS)

#: What the peers' virtualenv is made of: the peers pinned to the versions this
#: section was written and tested against, and the packages they run on.
PEER_REQUIREMENTS = (
    "faststream-outbox[asyncpg]==0.19.0",
    "faststream[kafka]==0.7.8",
    "omni-box[postgres,kafka]==0.3.1",
    "aiokafka==0.14.0",
    "asyncpg==0.32.0",
    "SQLAlchemy==2.1.9",
    "pydantic==2.14.4",
    "structlog==26.1.0",
)
#: Distributions whose installed versions results.md names.
PEER_DISTRIBUTIONS = ("faststream-outbox", "faststream", "omni-box", "aiokafka", "SQLAlchemy")
PEER_APPS = Path(__file__).resolve().parent / "peer_apps"
SCRIPTS = {FASTSTREAM: PEER_APPS / "faststream_peer.py", OMNIBOX: PEER_APPS / "omnibox_peer.py"}
MIN_PEER_PYTHON = (3, 12)

#: Each peer's publisher settings (see notes()): what its documentation offers
#: for throughput, tried on this machine's broker. The embedded broker answers
#: aiokafka's InitProducerId with an error, so both run without idempotence.
PEER_SETTINGS: dict[str, tuple[str, ...]] = {
    FASTSTREAM: (
        "--client=aiokafka",
        "--workers=64",
        "--fetch-batch=1000",
        "--flush-batch=100",
        "--min-fetch-interval=0.05",
        "--max-fetch-interval=0.5",
        "--lease-seconds=120",
        "--linger-ms=0",
        "--no-idempotence",
    ),
    OMNIBOX: (
        "--workers=4",
        "--batch-size=50",
        "--idle-seconds=0.05",
        "--linger-ms=0",
        "--no-idempotence",
    ),
}

#: Rows still to send when a peer's run ends (each library's own table).
PENDING_SQL = {
    FASTSTREAM: "SELECT count(*) FROM outbox",
    OMNIBOX: "SELECT count(*) FROM outbox_events WHERE status <> 'completed'",
}

#: What each system cannot do, from its source; shown on its rows.
CANNOT: dict[str, str] = {
    FASTSTREAM: (
        "has no ordering key: rows are claimed in (next_attempt_at, id) order and run by "
        "max_workers concurrent handlers, so per-key order holds only with max_workers=1; "
        "the Kafka key is set by our handler (KafkaResponse), the library has none"
    ),
    OMNIBOX: (
        "keeps per-key order by handing out only the head of each (topic, partition_key), "
        "ordered by created_at from the writing process's clock, not by commit: writers "
        "whose transactions interleave can have a later commit sent ahead; one Kafka "
        "round trip per event (send_and_wait), one event per key per fetch"
    ),
}


@dataclass(frozen=True)
class Shape:
    name: str
    label: str
    events: int
    keys: int
    #: True: clock from the publisher's process start; False: first to last event read.
    with_startup: bool
    target: Target | None


SIZE = 500
SHAPES = (
    Shape("startup", "start-up, 200 keys", 20_000, 200, True, Target(10.0)),
    Shape("steady", "steady, 200 keys", 100_000, 200, False, Target(20.0)),
    Shape("hot", "hot keys, 4 keys", 2_000, 4, False, None),
)
QUICK_EVENTS = {"startup": 2_000, "steady": 10_000, "hot": 500}
#: Longest a publisher may take to deliver a shape; quick runs get less.
BUDGET_SECONDS = {"startup": 240.0, "steady": 150.0, "hot": 120.0}
QUICK_BUDGET_SECONDS = 60.0
#: A publisher that delivers nothing new for this long is stopped.
STALL_SECONDS = 30.0
#: After the publisher is stopped: read on until nothing arrives for this long.
DRAIN_IDLE_SECONDS = 1.5
DRAIN_MAX_SECONDS = 20.0
POLL_SECONDS = 0.01


def payload(i: int, keys: int, size: int = SIZE) -> dict[str, Any]:
    """Event ``i``: its key and per-key sequence number, padded to ``size`` bytes of JSON.

    The scripts in :mod:`bench.peer_apps` build the same payloads.
    """
    key = f"customer-{i % keys:05d}"
    data: dict[str, Any] = {"bench_key": key, "bench_seq": i // keys + 1, "pad": ""}
    room = max(0, size - len(json.dumps(data, separators=(",", ":"))))
    data["pad"] = random.Random(i).randbytes((room + 1) // 2).hex()[:room]
    return data


def workload(events: int, keys: int, topic: str) -> Iterator[Event]:
    for i in range(events):
        data = payload(i, keys)
        yield Event(type="bench.peer", key=data["bench_key"], data=data, topic=topic)


def expected_ids(events: int, keys: int) -> set[tuple[str, int]]:
    return {(f"customer-{i % keys:05d}", i // keys + 1) for i in range(events)}


# The peers' virtualenv --------------------------------------------------------


@dataclass(frozen=True)
class PeerEnvironment:
    python: Path
    #: Installed versions of PEER_DISTRIBUTIONS.
    versions: dict[str, str]
    interpreter: str


def interpreter_version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        return int(out[0]), int(out[1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def find_interpreter() -> tuple[str | None, str]:
    """A Python >= 3.12 for the peers, and where it was looked for (for a 'not run' note)."""
    candidates: list[str] = []
    explicit = os.environ.get("OUTBOX_BENCH_PEER_PYTHON")
    if explicit:
        candidates.append(explicit)
    candidates += [found for name in ("python3.13", "python3.12") if (found := shutil.which(name))]
    candidates += sorted(
        glob.glob("/root/.pyenv/versions/3.1[23]*/bin/python"),
        key=lambda p: [int(x) if x.isdigit() else 0 for x in Path(p).parts[-3].split(".")],
        reverse=True,
    )
    for python in candidates:
        version = interpreter_version(python)
        if version is not None and version >= MIN_PEER_PYTHON:
            return python, ""
    looked = "$OUTBOX_BENCH_PEER_PYTHON, python3.13/python3.12 on PATH, /root/.pyenv/versions"
    return None, f"no Python >= 3.12 found ({looked})"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "outbox-kafka-bench" / "peers-venv"


def peer_environment(log: Callable[[str], None]) -> PeerEnvironment | str:
    """The peers' virtualenv, made (once) if its recorded contents differ; else why not."""
    python, reason = find_interpreter()
    if python is None:
        return reason
    venv = cache_dir()
    venv_python = venv / "bin" / "python"
    stamp = venv / "bench-requirements.txt"
    wanted = "\n".join([f"# interpreter {Path(python).resolve()}", *PEER_REQUIREMENTS]) + "\n"
    current = stamp.read_text(encoding="utf-8") if stamp.exists() else None
    if current != wanted or not venv_python.exists():
        log(f"{NAME}: making the peers' virtualenv in {venv} with {python} (once)")
        venv.parent.mkdir(parents=True, exist_ok=True)
        steps = [
            [python, "-m", "venv", "--clear", str(venv)],
            [
                str(venv_python),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                *PEER_REQUIREMENTS,
            ],
        ]
        for step in steps:
            try:
                done = subprocess.run(
                    step, capture_output=True, text=True, timeout=900, env=peer_env()
                )
            except (OSError, subprocess.SubprocessError) as exc:
                return f"making the peers' virtualenv failed: {exc}"
            if done.returncode != 0:
                lines = [ln for ln in done.stderr.splitlines() if "WARNING" not in ln]
                tail = " | ".join(lines[-3:]) or f"exit {done.returncode}"
                return f"{' '.join(step[:4])} failed: {tail}"
        stamp.write_text(wanted, encoding="utf-8")
    probe = (
        "import importlib.metadata as m, json, sys; "
        "print(json.dumps({d: m.version(d) for d in sys.argv[1:]}))"
    )
    try:
        found = subprocess.run(
            [str(venv_python), "-c", probe, *PEER_DISTRIBUTIONS],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            env=peer_env(),
        )
        versions: dict[str, str] = json.loads(found.stdout)
        label = subprocess.run(
            [str(venv_python), "--version"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return f"the peers' virtualenv in {venv} does not answer: {exc}"
    return PeerEnvironment(venv_python, versions, f"{label} ({python})")


def peer_env() -> dict[str, str]:
    """This process's environment less what would point another Python at our packages."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("OUTBOX_")}


# Processes ------------------------------------------------------------------


class PeerProcess:
    """A peer script in the peers' virtualenv; output to files (no pipe can block it)."""

    def __init__(self, env: PeerEnvironment, peer: str, args: Sequence[str]) -> None:
        self._out: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self.process = subprocess.Popen(
            [str(env.python), str(SCRIPTS[peer]), *args],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=peer_env(),
        )
        self.pid = self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def finish(self, timeout: float) -> tuple[int, str]:
        """Wait (SIGKILL after ``timeout``); the exit code and the output's last lines."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._out.seek(0)
        lines = self._out.read().decode(errors="replace").splitlines()
        self._out.close()
        return self.process.returncode, " | ".join(lines[-6:])

    def stop(self, timeout: float = 30.0) -> tuple[int, str]:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
        return self.finish(timeout)


# The verifying consumer -----------------------------------------------------


@dataclass
class Read:
    """One record as read: when (wall clock), where, its Kafka key, its value, and its
    Kafka timestamp (the producer's CreateTime; wall clock too), if it has one."""

    at: float
    partition: int
    key: bytes | None
    value: bytes
    stamp: float | None


def event_of(value: bytes) -> tuple[str, int] | None:
    """(key, seq) from a record's JSON: at the top, in ``data`` (ours) or ``payload``."""
    try:
        doc = json.loads(value)
    except ValueError:
        return None
    for body in (doc, doc.get("data"), doc.get("payload")) if isinstance(doc, dict) else ():
        if isinstance(body, dict) and "bench_key" in body and "bench_seq" in body:
            return str(body["bench_key"]), int(body["bench_seq"])
    return None


@dataclass
class Verdict:
    """What the consumer found in one run."""

    seen: int = 0
    duplicates: int = 0
    order_violations: int = 0
    keys_on_several_partitions: int = 0
    not_murmur2: int = 0
    key_mismatch: int = 0
    unreadable: int = 0
    value_bytes: float = 0.0


class TopicReader:
    """Reads every partition of a topic from offset 0 and keeps every record.

    Values are parsed only once as many records as expected events have
    arrived, so that parsing does not slow the reading of a fast publisher.
    """

    def __init__(self, bootstrap: str, topic: str, expected: set[tuple[str, int]]) -> None:
        self.expected = expected
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-peers-{os.getpid()}-{time.monotonic_ns()}",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 20,
            }
        )
        self.consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        self.reads: list[Read] = []
        self._parsed = 0
        self.events: list[tuple[str, int] | None] = []
        self.seen: set[tuple[str, int]] = set()
        #: The earliest Kafka timestamp of the records read: when the publisher sent its first.
        self.first_sent: float | None = None
        #: When the last new event (not read before) was read; when every event was.
        self.last_new_at: float | None = None
        self.complete_at: float | None = None

    def close(self) -> None:
        self.consumer.close()

    def warm_up(self) -> None:
        """Connect and fetch metadata before the clock starts (the topic is empty)."""
        self.poll(0.5)

    def poll(self, timeout: float = POLL_SECONDS) -> int:
        got = 0
        for message in self.consumer.consume(1000, timeout):
            if message.error() is not None:
                continue
            at = time.time()
            kind, millis = message.timestamp()
            stamp = millis / 1000 if kind != TIMESTAMP_NOT_AVAILABLE else None
            if stamp is not None and (self.first_sent is None or stamp < self.first_sent):
                self.first_sent = stamp
            self.reads.append(
                Read(at, message.partition() or 0, message.key(), message.value() or b"", stamp)
            )
            got += 1
        if len(self.reads) >= len(self.expected):
            self._parse()
        return got

    def _parse(self) -> None:
        for read in self.reads[self._parsed :]:
            event = event_of(read.value)
            self.events.append(event)
            if event is not None and event not in self.seen:
                self.seen.add(event)
                self.last_new_at = read.at
                if self.complete_at is None and len(self.seen) >= len(self.expected):
                    self.complete_at = read.at
        self._parsed = len(self.reads)

    def read_until_complete(
        self, deadline: float, alive: Callable[[], bool]
    ) -> tuple[bool, str | None]:
        """Read until every expected event is in; (complete, why it stopped early)."""
        last_progress = time.monotonic()
        while self.complete_at is None:
            if self.poll():
                last_progress = time.monotonic()
            now = time.monotonic()
            if now > deadline:
                return False, "budget"
            if now - last_progress > STALL_SECONDS:
                return False, "stall"
            if not alive():
                self.drain()
                return self.complete_at is not None, "exit"
        return True, None

    def drain(self) -> None:
        """Read until nothing arrives for a while (late records, duplicates), then parse all."""
        deadline = time.monotonic() + DRAIN_MAX_SECONDS
        idle_since = time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - idle_since < DRAIN_IDLE_SECONDS:
            if self.poll(0.1):
                idle_since = time.monotonic()
        self._parse()

    def verdict(self) -> Verdict:
        self._parse()
        v = Verdict(seen=len(self.seen & self.expected))
        counts = Counter(e for e in self.events if e is not None)
        v.duplicates = sum(n - 1 for n in counts.values() if n > 1)
        v.unreadable = sum(e is None for e in self.events)
        # Per partition in offset order, per key: first occurrences read after a later one.
        highest: dict[tuple[int, str], int] = {}
        partitions: dict[str, set[int]] = {}
        first: set[tuple[str, int]] = set()
        for read, event in zip(self.reads, self.events, strict=True):
            if event is None:
                continue
            key, seq = event
            partitions.setdefault(key, set()).add(read.partition)
            if read.key != key.encode():
                v.key_mismatch += 1
            elif read.partition != key_partition(read.key, PARTITIONS):
                v.not_murmur2 += 1
            if event in first:
                continue
            first.add(event)
            top = highest.get((read.partition, key), 0)
            if seq < top:
                v.order_violations += 1
            else:
                highest[(read.partition, key)] = seq
        v.keys_on_several_partitions = sum(len(p) > 1 for p in partitions.values())
        if self.reads:
            v.value_bytes = statistics.fmean(len(r.value) for r in self.reads)
        return v


# Runs ---------------------------------------------------------------------------


@dataclass
class Run:
    """One system on one shape, one round."""

    rate: float
    verdict: Verdict
    expected: int
    complete: bool
    seconds: float
    #: Events the outbox still held to send at the end (a run stopped early).
    pending: int
    remark: str = ""

    @property
    def missing(self) -> int:
        return self.expected - self.verdict.seen

    @property
    def lost(self) -> int:
        """Never read, and no longer in the outbox either."""
        return max(0, self.missing - self.pending)


@dataclass
class Samples:
    runs: dict[tuple[str, str], list[Run]] = field(default_factory=dict)

    def add(self, system: str, shape: str, run: Run) -> None:
        self.runs.setdefault((system, shape), []).append(run)

    def get(self, system: str, shape: str) -> list[Run]:
        return self.runs.get((system, shape), [])


def asyncpg_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql+asyncpg").render_as_string(False)


def count_pending(url: str, sql: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(sql)).scalar_one())
    except Exception:
        return -1
    finally:
        engine.dispose()


class PeersBench:
    def __init__(self, ctx: BenchContext, kafka: Kafka, env: PeerEnvironment | str) -> None:
        self.ctx = ctx
        self.kafka = kafka
        self.env = env
        self.outbox = Outbox()
        self.samples = Samples()

    def log(self, message: str) -> None:
        self.ctx.log(f"{NAME}: {message} (load {load_average()})")

    def events(self, shape: Shape) -> int:
        return QUICK_EVENTS[shape.name] if self.ctx.quick else shape.events

    def budget(self, shape: Shape) -> float:
        return QUICK_BUDGET_SECONDS if self.ctx.quick else BUDGET_SECONDS[shape.name]

    def measure(self, system: str, shape: Shape) -> Run:
        events = self.events(shape)
        with (
            self.ctx.fresh_database("bench_peers") as url,
            self.kafka.topic("bench-peers") as topic,
        ):
            if system == OURS:
                return self.ours(shape, events, url, topic)
            return self.peer(system, shape, events, url, topic)

    def ours(self, shape: Shape, events: int, url: str, topic: str) -> Run:
        table = Table(self.ctx, url, self.outbox)
        try:
            table.fill(workload(events, shape.keys, topic))
            reader = TopicReader(self.kafka.bootstrap, topic, expected_ids(events, shape.keys))
            try:
                reader.warm_up()
                start = time.time()
                relay = RelayProcess(url, self.kafka.bootstrap, drain=False)
                try:
                    complete, why = reader.read_until_complete(
                        time.monotonic() + self.budget(shape), relay.alive
                    )
                finally:
                    exit = relay.stop()
                if exit.returncode != 0:
                    raise RuntimeError(
                        f"{NAME}: our relay exited {exit.returncode}: {exit.stderr[-2000:]}"
                    )
                reader.drain()
                return self.result(shape, reader, start, complete, why, table.scalar("pending"))
            finally:
                reader.close()
        finally:
            table.close()

    def peer(self, peer: str, shape: Shape, events: int, url: str, topic: str) -> Run:
        if isinstance(self.env, str):
            raise RuntimeError(self.env)
        common = [
            f"--database-url={asyncpg_url(url)}",
            f"--topic={topic}",
            f"--events={events}",
            f"--keys={shape.keys}",
            f"--size={SIZE}",
        ]
        code, output = PeerProcess(self.env, peer, ["fill", *common]).finish(timeout=900)
        if code != 0:
            raise RuntimeError(f"{peer}: the fill exited {code}: {output[-1500:]}")
        reader = TopicReader(self.kafka.bootstrap, topic, expected_ids(events, shape.keys))
        try:
            reader.warm_up()
            start = time.time()
            process = PeerProcess(
                self.env,
                peer,
                ["relay", *common, f"--bootstrap={self.kafka.bootstrap}", *PEER_SETTINGS[peer]],
            )
            try:
                complete, why = reader.read_until_complete(
                    time.monotonic() + self.budget(shape), process.alive
                )
            finally:
                code, output = process.stop()
            reader.drain()
            run = self.result(
                shape, reader, start, complete, why, count_pending(url, PENDING_SQL[peer])
            )
            if why == "exit":
                run.remark = f"the publisher exited {code}: {output[-300:]}"
            return run
        finally:
            reader.close()

    def result(
        self,
        shape: Shape,
        reader: TopicReader,
        start: float,
        complete: bool,
        why: str | None,
        pending: int,
    ) -> Run:
        verdict = reader.verdict()
        end = reader.complete_at or reader.last_new_at
        begin = start if shape.with_startup else reader.first_sent
        seconds = 0.0 if end is None or begin is None else end - begin
        rate = len(reader.seen) / seconds if seconds > 0 else 0.0
        run = Run(rate, verdict, len(reader.expected), complete, seconds, pending)
        if not complete:
            reason = {
                "budget": f"not all delivered within the {self.budget(shape):.0f} s budget",
                "stall": f"nothing new for {STALL_SECONDS:.0f} s",
                "exit": "the publisher exited",
            }.get(why or "", why or "")
            run.remark = f"stopped: {reason}; {verdict.seen:,} of {run.expected:,} delivered"
        return run

    def run(self) -> None:
        for round_ in range(self.ctx.runs):
            for shape in SHAPES:
                for system in SYSTEMS:
                    if system != OURS and isinstance(self.env, str):
                        continue
                    self.log(
                        f"run {round_ + 1}/{self.ctx.runs}, {shape.label}, {system}, "
                        f"{self.events(shape):,} events"
                    )
                    try:
                        run = self.measure(system, shape)
                    except RuntimeError as exc:
                        if system == OURS:
                            raise
                        # A peer that fails is reported, not skipped: rate 0, the reason.
                        events = self.events(shape)
                        run = Run(0.0, Verdict(), events, False, 0.0, -1, f"failed: {exc}"[:400])
                    self.samples.add(system, shape.name, run)
                    v = run.verdict
                    self.log(
                        f"{system}: {run.rate:,.0f} events/s over {run.seconds:.2f} s; "
                        f"read {v.seen:,}/{run.expected:,}, dup {v.duplicates}, order "
                        f"{v.order_violations}, lost {run.lost}, pending {run.pending}, "
                        f"not murmur2 {v.not_murmur2}, key mismatch {v.key_mismatch}"
                        + (f"; {run.remark}" if run.remark else "")
                    )

    # Results ---------------------------------------------------------------

    def checks(self, runs: Sequence[Run]) -> str:
        def total(values: Sequence[int]) -> str:
            return "/".join(f"{n:,}" for n in values)

        lost = [r.lost for r in runs]
        dups = [r.verdict.duplicates for r in runs]
        order = [r.verdict.order_violations for r in runs]
        parts = [
            f"lost {total(lost)}",
            f"duplicates {total(dups)}",
            f"per-key order violations {total(order)}",
        ]
        split = sum(r.verdict.keys_on_several_partitions for r in runs)
        mismatch = sum(r.verdict.key_mismatch for r in runs)
        off = sum(r.verdict.not_murmur2 for r in runs)
        read = sum(r.verdict.seen for r in runs)
        if mismatch:
            parts.append(f"records whose Kafka key is not the event's: {mismatch:,}")
        parts.append(
            "murmur2 partitioning: yes"
            if not off and not mismatch and read
            else f"murmur2 partitioning: no ({off:,} records elsewhere)"
        )
        if split:
            parts.append(f"keys on several partitions: {split}")
        unreadable = sum(r.verdict.unreadable for r in runs)
        if unreadable:
            parts.append(f"unreadable records: {unreadable}")
        remarks = [f"run {i + 1}: {r.remark}" for i, r in enumerate(runs) if r.remark]
        return "; ".join(parts + remarks)

    def results(self) -> list[Result]:
        results: list[Result] = []
        for shape in SHAPES:
            events = self.events(shape)
            rates: dict[str, list[float]] = {}
            for system in SYSTEMS:
                runs = self.samples.get(system, shape.name)
                measurement = f"{shape.label}, {events:,} events: {system}"
                if not runs:
                    reason = self.env if isinstance(self.env, str) else "no run"
                    results.append(
                        Result(
                            NAME,
                            measurement,
                            "events/s",
                            (math.nan,),
                            shape.keys,
                            note=f"not run: {reason}",
                        )
                    )
                    continue
                rates[system] = [r.rate for r in runs]
                note = self.checks(runs)
                if system in CANNOT:
                    note += f"; cannot: {CANNOT[system]}"
                results.append(
                    Result(
                        NAME, measurement, "events/s", tuple(rates[system]), shape.keys, note=note
                    )
                )
            results.append(self.ratio(shape, rates))
        return results

    def ratio(self, shape: Shape, rates: dict[str, list[float]]) -> Result:
        measurement = f"{shape.label}: {OURS} ÷ best peer"
        peers = [p for p in PEERS if p in rates]
        if OURS not in rates or not peers:
            return Result(
                NAME,
                measurement,
                "x",
                (math.nan,),
                target=shape.target,
                note="not measured: no peer ran",
            )
        best: list[float] = []
        winners: list[str] = []
        for i in range(len(rates[OURS])):
            winner = max(peers, key=lambda p: rates[p][i])
            winners.append(winner)
            best.append(rates[winner][i])
        usable = [b > 0 for b in best]
        ratios = paired_ratios(
            [o for o, ok in zip(rates[OURS], usable, strict=True) if ok],
            [b for b, ok in zip(best, usable, strict=True) if ok],
        )
        each = "; ".join(
            f"÷ {p}: {statistics.median(paired_ratios(rates[OURS], rates[p])):.1f}x"
            for p in peers
            if all(rates[p])
        )
        note = f"best peer per run: {', '.join(winners)}" + (f"; median {each}" if each else "")
        if not ratios:
            return Result(
                NAME, measurement, "x", (math.nan,), target=shape.target, note="no peer delivered"
            )
        return Result(NAME, measurement, "x", ratios, target=shape.target, note=note)

    def notes(self) -> list[str]:
        sizes = []
        for system in SYSTEMS:
            runs = [r for s in SHAPES for r in self.samples.get(system, s.name)]
            values = [r.verdict.value_bytes for r in runs if r.verdict.value_bytes]
            if values:
                sizes.append(f"{system} {statistics.fmean(values):.0f} B")
        shapes = "; ".join(
            f"{s.label}: {self.events(s):,} events, "
            + (
                "clock from the publisher's process start until the consumer has read every event"
                if s.with_startup
                else "clock from the publisher's first record (the earliest Kafka "
                "timestamp on the topic, the producer's CreateTime) until the consumer has "
                "read every event (start-up excluded)"
            )
            for s in SHAPES
        )
        lines = [
            f"{NAME}: three systems on the same PostgreSQL server and broker, one publisher "
            f"process each, a fresh database and a fresh topic of {PARTITIONS} partitions per "
            f"run; events of {SIZE} B of JSON data each carrying its key and per-key "
            f"sequence number (values on Kafka, mean: {', '.join(sizes) or 'none read'}); "
            f"{shapes}; both clocks on the wall clock, in ms for the timestamps. Rates "
            "count distinct events (N / seconds); a run stopped at its budget "
            f"({', '.join(f'{k} {v:.0f} s' for k, v in BUDGET_SECONDS.items())}; quick "
            f"{QUICK_BUDGET_SECONDS:.0f} s) or after {STALL_SECONDS:.0f} s without a new "
            "event is rated over what it delivered, and its row says so. Rounds run the "
            "three systems one after another on each shape; ratios are ours ÷ the better "
            "peer of the same round",
            f"{NAME}: verification: a confluent-kafka consumer assign()s every partition from "
            "offset 0 before the publisher starts and keeps every record; after the run it "
            f"reads on until nothing arrives for {DRAIN_IDLE_SECONDS:g} s. lost = expected "
            "events never read and no longer in the outbox; duplicates = reads of an event "
            "beyond its first; per-key order violations = first reads of an event after a "
            "later event of its key on the same partition; murmur2 = every record's Kafka "
            "key is its event's key and sits on the partition Kafka's Java client would "
            "choose for it",
            f"{NAME}: {OURS}: one `python -m outbox_kafka.cli relay` process (run mode, "
            "RelaySettings defaults: batch 1,000, linger.ms 5, acks=all, idempotence, "
            f"murmur2_random), the outbox filled by enqueue_many ({FILL_BATCH:,} per call) "
            "and ANALYZEd, untimed",
        ]
        if isinstance(self.env, str):
            lines.append(f"{NAME}: the peers were not run: {self.env}")
            return lines
        v = self.env.versions
        lines += [
            f"{NAME}: peers in their own virtualenv ({cache_dir()}, {self.env.interpreter}): "
            + ", ".join(f"{d} {v.get(d, '?')}" for d in PEER_DISTRIBUTIONS)
            + "; their scripts are bench/peer_apps/*.py. The embedded broker fails "
            "aiokafka's InitProducerId (UnknownError), so both peers' aiokafka producers run "
            "with acks=all and without idempotence",
            f"{NAME}: {FASTSTREAM}: filled by OutboxBroker.publish_batch (1,000 rows per "
            "transaction); relayed as its docs show, an outbox subscriber whose handler "
            "returns the body as a KafkaResponse with the event's key, under a FastStream "
            "KafkaBroker (aiokafka) publisher, in a FastStream app; "
            + " ".join(PEER_SETTINGS[FASTSTREAM])
            + " (max_workers=64 was its fastest of 4/16/32/64 here, linger 0 faster than 5; "
            "per-message log lines at DEBUG, i.e. off)",
            f"{NAME}: {OMNIBOX}: filled by PostgresOutboxRepository.bulk_create of events "
            "from OmniBoxDomainService.create_outbox_event (1,000 per transaction); relayed "
            "by its documented loop, OutboxPublisher.publish_batch in a transaction per "
            "cycle, KafkaEventPublisher over AIOKafkaProducer with the EnvelopeEventConverter, "
            "in several concurrent loops (worker ids of their own); "
            + " ".join(PEER_SETTINGS[OMNIBOX])
            + " (4 loops of 50 was its fastest of 1x200, 2x100, 4x50, 8x25 here; its fetch "
            "hands out at most one event per key)",
        ]
        return lines


def run(ctx: BenchContext) -> list[Result]:
    if ctx.bootstrap_servers is None:
        raise RuntimeError("the peers bench needs Kafka (--bootstrap-servers or embedded)")
    env = peer_environment(ctx.log)
    if isinstance(env, str):
        ctx.log(f"{NAME}: the peers will not run: {env}")
    else:
        ctx.log(f"{NAME}: peers: {env.versions} on {env.interpreter}")
    bench = PeersBench(ctx, Kafka(ctx.bootstrap_servers), env)
    bench.run()
    ctx.notes += bench.notes()
    return bench.results()
