"""``outbox-kafka relay --source log`` as an operator runs it: a drain, and a second
relay that waits while the first reads the slot and takes over when it is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from outbox_kafka.relay.log_reader import LogReader
from tests.log_support import LOG_CHECK_LINES, NAMES, log_database, log_outbox, read_log
from tests.relay_support import consume_all, per_key_order

REPO = Path(__file__).resolve().parent.parent.parent
CLI = str(Path(sys.executable).with_name("outbox-kafka"))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["COLUMNS"] = "200"
    return env


def _args(log_url: str, bootstrap: str, *extra: str) -> list[str]:
    return [
        CLI,
        "relay",
        "--source",
        "log",
        "--database-url",
        log_url,
        "--bootstrap-servers",
        bootstrap,
        "--lease-seconds",
        "5",
        "--delivery-timeout-ms",
        "3000",
        "--poll-interval",
        "0.1",
        *extra,
    ]


def _run(
    command: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run an ``outbox-kafka`` command line to its end, output captured; ``env``
    adds variables."""
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**_env(), **(env or {})},
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


def _emit(engine: sa.Engine, topic: str, key: str, first: int, last: int) -> None:
    outbox = log_outbox()
    for n in range(first, last + 1):
        with engine.begin() as conn:
            outbox.enqueue(conn, type="log.test", key=key, data={"n": n}, topic=topic)


def test_drain_publishes_what_committed_and_exits_0(
    log_engine: sa.Engine, log_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(2)
    _emit(log_engine, topic, "k", 1, 25)
    done = _run(_args(log_url, kafka_bootstrap, "--drain", "--drain-timeout", "60"), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "published 25 events from the log" in done.stdout
    records = consume_all(kafka_bootstrap, topic, 25)
    assert sorted(r.value["data"]["n"] for r in records) == list(range(1, 26))


def _ready(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:  # not listening yet
        return 0, str(exc)


def _gauge(port: int, name: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _start(log_url: str, bootstrap: str, port: int) -> subprocess.Popen[str]:
    """A relay in run mode serving its endpoints on ``port``."""
    return subprocess.Popen(
        _args(log_url, bootstrap, "--metrics-port", str(port)),
        env=_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_a_second_relay_waits_then_takes_over_when_the_first_is_killed(
    log_engine: sa.Engine, log_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(2)
    ports = [_free_port(), _free_port()]
    first = _start(log_url, kafka_bootstrap, ports[0])
    second: subprocess.Popen[str] | None = None
    try:
        _emit(log_engine, topic, "k", 1, 20)
        assert _wait(lambda: _ready(ports[0])[0] == 200, 60), _ready(ports[0])
        second = _start(log_url, kafka_bootstrap, ports[1])
        # The second is alive and not ready: the slot is read by the first.
        assert _wait(lambda: _gauge(ports[1], "outbox_log_waiting_for_slot") == 1.0, 60), _ready(
            ports[1]
        )
        status, body = _ready(ports[1])
        assert status == 503
        assert json.loads(body)["loop:log"] == "another relay reads the slot", body
        assert consume_all(kafka_bootstrap, topic, 20)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
        _emit(log_engine, topic, "k", 21, 40)
        assert _wait(lambda: _ready(ports[1])[0] == 200, 60), _ready(ports[1])
        records = consume_all(kafka_bootstrap, topic, 40)
        (ids,) = per_key_order(records).values()
        by_id = {r.event_id: r.value["data"]["n"] for r in records}
        # Nothing lost, in commit order by first occurrence; copies only of what the
        # first relay had not acknowledged when it was killed.
        assert [by_id[i] for i in ids] == list(range(1, 41))
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(30)


def test_log_setup_says_what_it_made(logical_server_url: str) -> None:
    with log_database(logical_server_url, set_up=False) as url:
        runs = [_run([CLI, "log-setup", "--database-url", url], timeout=60) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    assert runs[0].stdout.splitlines() == [
        "publication outbox_kafka_6_public_outbox: created",
        "slot outbox_kafka_6_public_outbox: created",
        "pg_logical_emit_message: not executable by PUBLIC",
    ]
    assert "publication outbox_kafka_6_public_outbox: exists" in runs[1].stdout
    assert "slot outbox_kafka_6_public_outbox: exists" in runs[1].stdout


def test_check_reports_what_the_log_mode_needs(log_url: str, kafka_bootstrap: str) -> None:
    args = ["check", "--source", "log", "--database-url", log_url]
    args += ["--bootstrap-servers", kafka_bootstrap, "--check-timeout", "5"]
    done = _run([CLI, *args, "--json"], timeout=60)
    lines = {c["name"]: (c["ok"], c["detail"]) for c in json.loads(done.stdout)["checks"]}
    names = list(lines)
    after = names.index("migrations") + 1
    assert names[after : after + len(LOG_CHECK_LINES)] == LOG_CHECK_LINES
    # The test database is set up without log-setup's revoke: only that line fails.
    assert [name for name, (ok, _) in lines.items() if not ok] == ["emit privilege"]
    assert done.returncode == 1, done.stderr
    # Nothing of the polling relay's retries in the settings line.
    assert lines["settings"][1] == "valid: table public.outbox, delivery timeout 10000 ms"


def test_check_looks_for_the_topics_of_the_events_the_slot_holds(
    log_engine: sa.Engine, log_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """The slot is peeked at, not consumed: a topic its events need that the broker
    lacks fails check, as a missing topic of the tables' pending events does."""
    there, missing = new_topic(1), f"missing-{uuid.uuid4().hex[:12]}"
    _emit(log_engine, there, "k", 1, 2)
    _emit(log_engine, missing, "k", 3, 5)
    args = [CLI, "check", "--source", "log", "--database-url", log_url]
    args += ["--bootstrap-servers", kafka_bootstrap, "--check-timeout", "5", "--json"]

    def lines(*extra: str) -> dict[str, tuple[bool, str]]:
        done = _run([*args, *extra], timeout=60)
        return {c["name"]: (c["ok"], c["detail"]) for c in json.loads(done.stdout)["checks"]}

    found = lines()
    assert found[f"topic {there}"] == (True, "exists; 2 pending events")
    assert found[f"topic {missing}"] == (
        False,
        "missing; 3 pending events wait for it (create it, or let the relay create it: "
        "--create-topics <partitions>)",
    )
    assert lines("--create-topics", "1")[f"topic {missing}"] == (
        True,
        "missing; the relay creates it (3 pending events)",
    )
    # Peeking consumed nothing: the relay publishes all five.
    reader = LogReader(log_url, NAMES)
    reader.open()
    try:
        # While a relay reads the slot, the server lets nobody else: not read.
        read_now = lines()
        # Nor does a draining relay: it says so and exits 2.
        drained = _run(_args(log_url, kafka_bootstrap, "--drain"), timeout=60)
    finally:
        reader.close()
    assert drained.returncode == 2
    assert f"replication slot {NAMES.log_slot} is read by another session" in drained.stderr
    assert "Traceback" not in drained.stderr
    assert read_now["pending topics"] == (
        True,
        "not read: another session reads the slot now (a relay, most likely)",
    )
    assert not any(name.startswith("topic ") for name in read_now)
    assert sum(len(t.events) for t in read_log(log_url)[0]) == 5


def test_check_refuses_several_outboxes_as_the_relay_does(
    log_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    outboxes = tmp_path / "outboxes.toml"
    outboxes.write_text(f'[outboxes.main]\ndatabase_url = "{log_url}"\n')
    args = ["--source", "log", "--outboxes-file", str(outboxes)]
    args += ["--bootstrap-servers", kafka_bootstrap]
    checked = _run([CLI, "check", *args, "--check-timeout", "5", "--json"], timeout=60)
    lines = {c["name"]: (c["ok"], c["detail"]) for c in json.loads(checked.stdout)["checks"]}
    relayed = _run([CLI, "relay", *args, "--drain"], timeout=60)
    said = "--source log serves one outbox; --outboxes-file is for the polling relay"
    assert lines["settings"] == (False, said)
    assert checked.returncode == 1
    assert relayed.returncode == 2 and said in relayed.stderr


def test_options_of_the_polling_relay_are_refused_with_the_log(
    log_url: str, kafka_bootstrap: str
) -> None:
    """Retries, parking and retention are the polling relay's: set with --source log,
    by a flag or a variable, they are refused, by the relay and by check alike."""
    env = {"OUTBOX_PURGE_INTERVAL": "60"}
    given = ["--max-attempts", "3", "--on-exhausted", "park"]
    relayed = _run(_args(log_url, kafka_bootstrap, "--drain", *given), timeout=60, env=env)
    check_args = ["--source", "log", "--database-url", log_url, "--bootstrap-servers"]
    check_args += [kafka_bootstrap, "--check-timeout", "5", "--json"]
    checked = _run([CLI, "check", *check_args, *given], timeout=60, env=env)
    lines = {c["name"]: (c["ok"], c["detail"]) for c in json.loads(checked.stdout)["checks"]}
    said = (
        "--source log does not use --max-attempts (OUTBOX_MAX_ATTEMPTS), --on-exhausted "
        "(OUTBOX_ON_EXHAUSTED), --purge-interval (OUTBOX_PURGE_INTERVAL): only the polling "
        "relay retries, parks and keeps events in its tables; drop them"
    )
    assert relayed.returncode == 2 and said in relayed.stderr, relayed.stderr
    assert lines["settings"][0] is False and lines["settings"][1].startswith(said)
    assert checked.returncode == 1
    # Their defaults, given or not, are what the log relay does anyway.
    defaults = ["--on-exhausted", "continue", "--max-attempts", "50"]
    fine = _run([CLI, "check", *check_args, *defaults], timeout=60)
    assert dict((c["name"], c["ok"]) for c in json.loads(fine.stdout)["checks"])["settings"], (
        fine.stdout
    )


def test_create_topics_makes_a_missing_topic_before_its_first_event(
    log_engine: sa.Engine, log_url: str, kafka_bootstrap: str
) -> None:
    topic = f"made-{uuid.uuid4().hex[:12]}"
    _emit(log_engine, topic, "k", 1, 5)
    args = _args(
        log_url, kafka_bootstrap, "--drain", "--create-topics", "3", "--log-format", "json"
    )
    done = _run(args, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "published 5 events from the log" in done.stdout
    logged = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [(e["topic"], e["partitions"]) for e in logged if e.get("action") == "create_topic"] == [
        (topic, 3)
    ]
    metadata = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(topic, timeout=10)
    assert len(metadata.topics[topic].partitions) == 3
    records = consume_all(kafka_bootstrap, topic, 5)
    (ids,) = per_key_order(records).values()
    by_id = {r.event_id: r.value["data"]["n"] for r in records}
    assert [by_id[i] for i in ids] == [1, 2, 3, 4, 5]
