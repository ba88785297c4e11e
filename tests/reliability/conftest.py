"""Reliability scenarios: short in the normal suite, full size under ``make chaos``.

``make chaos`` sets ``OUTBOX_RELIABILITY=long``. Every scenario adds one row
to the table printed at the end of the session.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability import report
from tests.reliability.servers import PrivatePostgres


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not report.ROWS:
        return
    mode = "long (make chaos)" if report.LONG else "short"
    terminalreporter.section(f"reliability scenarios, {mode}")
    terminalreporter.write_line(report.markdown(report.ROWS))


@pytest.fixture(scope="session")
def private_postgres(work_dir: Path) -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of the tests' own on a loopback port, without TLS."""
    server = PrivatePostgres(work_dir / f"private-pg-{uuid.uuid4().hex[:8]}")
    try:
        yield server
    finally:
        server.close()
