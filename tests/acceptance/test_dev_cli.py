"""`outbox-kafka dev` as a separate process: it serves until a signal, then leaves nothing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from outbox_kafka.database import make_engine
from outbox_kafka.demo.embedded import free_port, port_is_free, postgres_running

CLI = [sys.executable, "-m", "outbox_kafka.cli", "dev"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}


def _read_exports(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        values[name] = value
    return values


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], dict[str, str]]:
    env_file = tmp_path / "stack.env"
    process = subprocess.Popen(
        [*CLI, "--data-dir", str(tmp_path / "data"), "--env-file", str(env_file), *extra],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not env_file.exists():
        if process.poll() is not None:
            raise AssertionError(f"dev exited {process.returncode}: {process.communicate()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("dev wrote no environment within 60 s")
        time.sleep(0.1)
    return process, _read_exports(env_file)


def _ports(exports: dict[str, str]) -> tuple[int, int]:
    pg = int(exports["OUTBOX_DATABASE_URL"].rsplit(":", 1)[1].split("/", 1)[0])
    kafka = int(exports["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"].rsplit(":", 1)[1])
    return pg, kafka


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_dev_serves_both_until_a_signal_then_stops_them(
    tmp_path: Path, stop_signal: signal.Signals
) -> None:
    process, exports = _start(tmp_path, "--postgres-port", "0", "--kafka-port", "0", "--migrate")
    pg_port, kafka_port = _ports(exports)
    try:
        engine = make_engine(exports["OUTBOX_DATABASE_URL"], poolclass=sa.NullPool)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar() == 0
        engine.dispose()
        admin = AdminClient({"bootstrap.servers": exports["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"]})
        assert admin.list_topics(timeout=10).brokers
    finally:
        process.send_signal(stop_signal)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    # What was printed is what was written to the file, and can be sourced.
    assert out == (tmp_path / "stack.env").read_text()
    assert "stopped PostgreSQL and the broker" in err
    assert not postgres_running(tmp_path / "data" / "postgres")
    assert port_is_free(pg_port) and port_is_free(kafka_port)


def test_dev_keeps_its_data_and_its_ports_between_runs_and_starts_for_the_log_mode(
    tmp_path: Path,
) -> None:
    pg_port, kafka_port = free_port(), free_port()
    ports = ["--postgres-port", str(pg_port), "--kafka-port", str(kafka_port)]
    first, exports = _start(tmp_path, *ports)
    engine = make_engine(exports["OUTBOX_DATABASE_URL"], poolclass=sa.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE kept (id int)"))
        assert conn.execute(sa.text("SHOW wal_level")).scalar() == "replica"
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 0
    (tmp_path / "stack.env").unlink()

    printed = subprocess.run(
        [*CLI, *ports, "--print-env"], env=_env(), capture_output=True, text=True, check=True
    )
    assert printed.stdout == "".join(f"export {k}={v}\n" for k, v in exports.items())

    # Started again for the log mode: the same data, decoded.
    second, again = _start(tmp_path, *ports, "--log-mode")
    try:
        assert again == exports
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM kept")).scalar() == 0
            assert conn.execute(sa.text("SHOW wal_level")).scalar() == "logical"
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_create_logical_replication_slot('kept', 'pgoutput')"))
        engine.dispose()
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0

    # Without --log-mode, a data directory with a logical slot cannot start: said in
    # the server's words and ours, without the embedded server package's dump.
    third = subprocess.run(
        [*CLI, "--data-dir", str(tmp_path / "data"), *ports],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert third.returncode == 2
    assert (
        'FATAL: logical replication slot "kept" exists, but "wal_level" < "logical"' in third.stderr
    )
    assert "start it with --log-mode, or use another --data-dir" in third.stderr
    assert "Failed postgres command" not in third.stderr
    assert not postgres_running(tmp_path / "data" / "postgres")


def test_dev_after_a_killed_run_stops_what_it_left_and_starts(tmp_path: Path) -> None:
    ports = ["--postgres-port", str(free_port()), "--kafka-port", str(free_port())]
    killed, exports = _start(tmp_path, *ports)
    killed.kill()
    killed.wait()
    (tmp_path / "stack.env").unlink()
    _, kafka_port = _ports(exports)
    assert not port_is_free(kafka_port)  # the broker outlived it

    again, _ = _start(tmp_path, *ports)
    again.send_signal(signal.SIGTERM)
    assert again.wait(timeout=60) == 0
    assert port_is_free(kafka_port)
    assert not postgres_running(tmp_path / "data" / "postgres")


@pytest.mark.parametrize("taken", ["--postgres-port", "--kafka-port"])
def test_dev_names_a_taken_port_and_leaves_nothing_running(tmp_path: Path, taken: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        other = "--kafka-port" if taken == "--postgres-port" else "--postgres-port"
        other_port = free_port()
        result = subprocess.run(
            [*CLI, "--data-dir", str(tmp_path / "data"), taken, str(port), other, str(other_port)],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 is taken" in result.stderr
    assert result.stdout == ""
    assert port_is_free(other_port)
    assert not postgres_running(tmp_path / "data" / "postgres")
