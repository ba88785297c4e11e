"""``outbox-kafka relay`` as operators watch it: endpoints, JSON logs, and no secrets anywhere."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox_kafka.demo.embedded import free_port
from tests.relay_support import delivered_count, enqueue_bulk, seq_events, topic_outbox, wait_until

REPO = Path(__file__).resolve().parent.parent.parent
CLI = str(Path(sys.executable).with_name("outbox-kafka"))

#: Every metric the relay exports from its start (labelled ones appear once used).
ALWAYS_EXPORTED = (
    "outbox_leases_lost_total",
    "outbox_database_errors_total",
    "outbox_events_purged_total",
    "outbox_claim_duration_seconds_bucket",
    "outbox_publish_duration_seconds_bucket",
    "outbox_mark_duration_seconds_bucket",
    "outbox_commit_to_ack_seconds_bucket",
    "outbox_kafka_producer_queue_messages",
    "outbox_pending_events",
    "outbox_oldest_pending_age_seconds",
    "outbox_parked_keys",
    "outbox_relay_last_cycle_timestamp_seconds",
    "outbox_relay_info",
)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["COLUMNS"] = "200"
    env.update(extra or {})
    return env


def with_password(database_url: str, password: str) -> str:
    """The same database behind a URL that carries a password (the test servers trust)."""
    return make_url(database_url).set(password=password).render_as_string(hide_password=False)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=15) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def sample(metrics: str, name: str, labels: str = "") -> float | None:
    prefix = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in metrics.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return None


def json_records(stderr: str) -> list[dict[str, Any]]:
    """Every stderr line as a JSON object (fails on any line that is not one)."""
    records = []
    for line in stderr.splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                raise AssertionError(f"not a JSON log line: {line!r}") from None
    return records


@pytest.fixture
def secrets() -> dict[str, str]:
    tag = uuid.uuid4().hex[:12]
    return {"db": f"db-pass-{tag}", "sasl": f"sasl-pass-{tag}", "key": f"key-pass-{tag}"}


@pytest.fixture
def relay_process() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [CLI, "relay", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(env),
            cwd=REPO,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def test_relay_serves_metrics_health_and_json_logs_without_secrets(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    secrets: dict[str, str],
    relay_process: Callable[..., subprocess.Popen[str]],
) -> None:
    topic = new_topic(2)
    port = free_port()
    proc = relay_process(
        "--database-url",
        with_password(database_url, secrets["db"]),
        "--bootstrap-servers",
        kafka_bootstrap,
        "--metrics-port",
        str(port),
        "--metrics-host",
        "127.0.0.1",
        "--log-format",
        "json",
        "--sample-interval",
        "0.5",
        "--poll-interval",
        "0.1",
        "--kafka-config",
        "statistics.interval.ms=200",
        "--kafka-config",
        f"sasl.password={secrets['sasl']}",
        env={"OUTBOX_KAFKA_CONFIG_SSL_KEY_PASSWORD": secrets["key"]},
    )
    try:
        wait_until(lambda: get(port, "/healthz")[0] == 200, 60, what="/healthz 200")
        status, body = get(port, "/readyz")
        assert status == 200, body
        assert json.loads(body) == {"status": "ok", "database": "ok", "kafka": "ok"}
        assert get(port, "/nothing-here")[0] == 404

        enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["a", "b", "c"], 12))
        wait_until(lambda: delivered_count(engine) == 12, 60, what="delivery")
        published = f'topic="{topic}"'

        def scraped() -> str:
            return get(port, "/metrics")[1]

        wait_until(
            lambda: sample(scraped(), "outbox_events_published_total", published) == 12,
            30,
            what="the published counter",
        )
        wait_until(
            lambda: "outbox_kafka_broker_rtt_seconds{" in scraped(), 30, what="broker RTT gauge"
        )
        metrics = scraped()
        for name in ALWAYS_EXPORTED:
            assert f"\n{name}" in metrics, name
        assert sample(metrics, "outbox_relay_last_cycle_timestamp_seconds")
        assert sample(metrics, "outbox_commit_to_ack_seconds_count") == 12
    finally:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr

    records = json_records(stderr)
    actions = [r.get("action") for r in records]
    assert "start" in actions and "stop" in actions and "http_start" in actions
    [started] = [r for r in records if r.get("action") == "start"]
    assert started["kafka"]["sasl.password"] == "***"
    assert started["kafka"]["ssl.key.password"] == "***"
    assert "***@" in started["database"]
    assert all("action" in r for r in records), [r for r in records if "action" not in r]
    for secret in secrets.values():
        assert secret not in stderr and secret not in stdout and secret not in metrics


def test_help_shows_the_new_flags_and_never_a_secret_from_the_environment(
    secrets: dict[str, str],
) -> None:
    env = clean_env(
        {
            "OUTBOX_DATABASE_URL": f"postgresql://relay:{secrets['db']}@db/app",
            "OUTBOX_KAFKA_CONFIG_SASL_PASSWORD": secrets["sasl"],
            "OUTBOX_KAFKA_CONFIG_SSL_KEYSTORE_PASSWORD": secrets["key"],
            "OUTBOX_METRICS_PORT": "9555",
        }
    )
    result = subprocess.run(
        [CLI, "relay", "--help"], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0
    for text in (
        "--metrics-port",
        "OUTBOX_METRICS_PORT",
        "--metrics-host",
        "OUTBOX_METRICS_HOST",
        "--sample-interval",
        "OUTBOX_SAMPLE_INTERVAL",
        "default: 9400",
        "default: 0.0.0.0",
    ):
        assert text in result.stdout, text
    for secret in secrets.values():
        assert secret not in result.stdout and secret not in result.stderr


def test_an_explicit_metrics_port_in_use_is_refused(
    database_url: str, kafka_bootstrap: str, secrets: dict[str, str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                CLI,
                "relay",
                "--database-url",
                with_password(database_url, secrets["db"]),
                "--bootstrap-servers",
                kafka_bootstrap,
                "--metrics-host",
                "127.0.0.1",
                "--metrics-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=60,
            check=False,
        )
    assert result.returncode == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
    assert secrets["db"] not in result.stderr


def test_drain_logs_each_action_as_json_with_its_fields(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(1)
    ids = enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["a", "b"], 4))
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET value = 'not json'::bytea WHERE event_id = :id"),
            {"id": ids[1]},
        )
    base = [CLI, "relay", "--drain", "--log-format", "json", "--lease-seconds", "5"]
    base += ["--delivery-timeout-ms", "3000", "--metrics-host", "127.0.0.1"]
    env = {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}

    # --drain serves no endpoints unless a port is given ...
    result = subprocess.run(
        base, capture_output=True, text=True, env=clean_env(env), timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "drained: 3 delivered, 1 discarded" in result.stdout
    records = json_records(result.stderr)
    assert "http_start" not in [r.get("action") for r in records]
    [discard] = [r for r in records if r.get("action") == "discard"]
    assert discard["level"] == "error"
    assert (discard["event_id"], discard["key"], discard["topic"]) == (ids[1], "b", topic)
    assert discard["attempt"] == 1
    assert "INVALID_ENVELOPE" in discard["error"]

    # ... and one given by its environment variable is served.
    port = free_port()
    result = subprocess.run(
        base,
        capture_output=True,
        text=True,
        env=clean_env({**env, "OUTBOX_METRICS_PORT": str(port)}),
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    [served] = [r for r in json_records(result.stderr) if r.get("action") == "http_start"]
    assert (served["host"], served["port"]) == ("127.0.0.1", port)
