"""Relays as separate processes, as they run in production: start, gate, stop, usage.

Each relay is ``python -m outbox_kafka.cli relay`` with only the bench's
settings (none of the caller's ``OUTBOX_*`` variables). CPU time (user +
system, all threads) comes from ``/proc/<pid>/stat``, read at both ends of a
measured window; peak memory is ``VmHWM`` from ``/proc/<pid>/status`` (not
``ru_maxrss``: Linux carries the high-water mark of the forking parent over
into the child's). Without ``/proc`` both read as 0.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

from outbox_kafka.demo.embedded import free_port

from .tables import Table

#: After every relay waits at the gate: time for their producers to finish
#: connecting and to get their producer ids, so none of that is timed.
GATE_GRACE_SECONDS = 0.5
POLL_SECONDS = 0.01
_TICKS = os.sysconf("SC_CLK_TCK")
#: Events published: the polling relay's counter (by topic) or the log relay's.
_PUBLISHED = re.compile(
    r"^outbox_(?:events|log)_published_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.MULTILINE
)


@dataclass(frozen=True)
class Exit:
    """How a relay process ended."""

    returncode: int
    stdout: str
    stderr: str


class RelayProcess:
    """One ``outbox-kafka relay`` process; its output goes to files (no pipe can block it).

    In run mode it serves ``/metrics`` on a free loopback port, read by
    :meth:`published`.
    """

    def __init__(
        self, database_url: str, bootstrap: str, *, drain: bool, extra: Sequence[str] = ()
    ) -> None:
        self.metrics_port = None if drain else free_port()
        command = [
            sys.executable,
            "-m",
            "outbox_kafka.cli",
            "relay",
            "--database-url",
            database_url,
            "--bootstrap-servers",
            bootstrap,
            "--log-level",
            "WARNING",
            *(
                ("--drain",)
                if self.metrics_port is None
                else ("--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port))
            ),
            *extra,
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        # Open for the life of the process; closed by wait().
        self._out: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self._err: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self.process = subprocess.Popen(
            command, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL, env=env
        )
        self.pid = self.process.pid
        self.peak_rss_bytes = 0
        self._exit: Exit | None = None

    def alive(self) -> bool:
        """Still running (not reaped: :meth:`wait` collects it)."""
        if self._exit is not None:
            return False
        found = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return found is None

    def cpu_seconds(self) -> float:
        """User + system CPU so far, all threads."""
        try:
            with open(f"/proc/{self.pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / _TICKS

    def sample_memory(self) -> int:
        """Update and return :attr:`peak_rss_bytes` from ``VmHWM``."""
        try:
            with open(f"/proc/{self.pid}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        found = int(line.split()[1]) * 1024
                        self.peak_rss_bytes = max(self.peak_rss_bytes, found)
                        break
        except OSError:
            pass
        return self.peak_rss_bytes

    def published(self) -> int:
        """Events Kafka acknowledged to this relay (its ``/metrics``)."""
        if self.metrics_port is None:
            raise RuntimeError("a --drain relay serves no metrics")
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode()
        return int(sum(float(v) for v in _PUBLISHED.findall(body)))

    def wait(self, timeout: float | None = None) -> Exit:
        """Wait for the exit, sampling memory meanwhile (kill after ``timeout``); reap once."""
        if self._exit is not None:
            return self._exit
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.alive():
            self.sample_memory()
            if deadline is not None and time.monotonic() > deadline:
                self.process.kill()
                break
            time.sleep(POLL_SECONDS)
        self.process.wait()
        self._out.seek(0)
        self._err.seek(0)
        self._exit = Exit(
            returncode=self.process.returncode,
            stdout=self._out.read().decode(errors="replace"),
            stderr=self._err.read().decode(errors="replace"),
        )
        self._out.close()
        self._err.close()
        return self._exit

    def stop(self, timeout: float = 60.0) -> Exit:
        """SIGTERM (the relay records what is in flight and exits 0), then wait."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
        return self.wait(timeout)

    def wait_for(self, done: Callable[[], bool], what: str, timeout: float) -> None:
        """Poll ``done`` until true; raise if the relay exits first (with its stderr) or
        ``timeout`` seconds pass (``what`` names the wait)."""
        deadline = time.monotonic() + timeout
        while not done():
            if not self.alive():
                self.checked(self.wait())
                raise RuntimeError(f"the relay exited while {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not done after {timeout:.0f} s")
            time.sleep(POLL_SECONDS)

    def checked(self, exit: Exit) -> Exit:
        if exit.returncode != 0:
            raise RuntimeError(f"relay process exited {exit.returncode}: {exit.stderr[-2000:]}")
        return exit


@dataclass(frozen=True)
class RelaysRun:
    #: From the gate opening until nothing was pending.
    seconds: float
    #: Per process: CPU inside the window, events Kafka acknowledged to it, peak RSS.
    cpu_seconds: list[float]
    published: list[int]
    peak_rss_bytes: list[int]
    #: The processes' log lines (warnings and up).
    logs: list[str]


def gated_relays(table: Table, bootstrap: str, count: int, timeout: float = 300.0) -> RelaysRun:
    """Run ``count`` relay processes on ``table`` until nothing is pending.

    They start behind the gate (:meth:`Table.start_gate`); the clock starts
    when it opens, after every process waits at its first claim, and stops
    when the bench first sees no pending event. Then they get SIGTERM.
    """
    processes: list[RelayProcess] = []
    try:
        with table.start_gate() as gate:
            processes += [RelayProcess(table.url, bootstrap, drain=False) for _ in range(count)]
            gate.wait_for(count, alive=lambda: all(p.alive() for p in processes))
            time.sleep(GATE_GRACE_SECONDS)
            before = [p.cpu_seconds() for p in processes]
            start = time.perf_counter()
            gate.open()
            deadline = time.monotonic() + timeout
            while table.scalar("any_pending"):
                if not all(p.alive() for p in processes) or time.monotonic() > deadline:
                    raise RuntimeError(f"relay x{count}: events still pending, a relay stopped")
                time.sleep(POLL_SECONDS)
            seconds = time.perf_counter() - start
        cpu = [p.cpu_seconds() - b for p, b in zip(processes, before, strict=True)]
        memory = [p.sample_memory() for p in processes]
        published = [p.published() for p in processes]
    finally:
        exits = [p.stop() for p in processes]
    for p, e in zip(processes, exits, strict=True):
        p.checked(e)
    return RelaysRun(
        seconds=seconds,
        cpu_seconds=cpu,
        published=published,
        peak_rss_bytes=memory,
        logs=[line for e in exits for line in e.stderr.splitlines()],
    )


@dataclass(frozen=True)
class Startup:
    seconds: float
    cpu_seconds: float
    peak_rss_bytes: int


def empty_drain(database_url: str, bootstrap: str) -> Startup:
    """One ``relay --drain`` on an empty outbox, start to exit."""
    start = time.perf_counter()
    process = RelayProcess(database_url, bootstrap, drain=True)
    cpu = 0.0
    while process.alive():
        cpu = process.cpu_seconds()
        process.sample_memory()
        time.sleep(POLL_SECONDS)
    process.checked(process.wait(timeout=120))
    return Startup(time.perf_counter() - start, cpu, process.peak_rss_bytes)
