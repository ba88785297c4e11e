"""Why embedded PostgreSQL did not start, read from its log: this start's lines only."""

from __future__ import annotations

from pathlib import Path

from outbox_kafka.demo.embedded import why_not_started

EARLIER = (
    "2026-12-07 10:00:00.000 UTC [1] LOG:  starting PostgreSQL 18.6\n"
    "2026-12-07 10:05:00.000 UTC [9] FATAL:  terminating connection due to administrator "
    "command\n"
)
THIS_START = (
    "2026-12-07 11:00:00.000 UTC [2] LOG:  starting PostgreSQL 18.6\n"
    '2026-12-07 11:00:00.001 UTC [3] FATAL:  logical replication slot "s" exists, but '
    '"wal_level" < "logical"\n'
    '2026-12-07 11:00:00.001 UTC [3] HINT:  Change "wal_level" to be "logical" or higher.\n'
    "2026-12-07 11:00:00.002 UTC [2] LOG:  startup process (PID 3) exited with exit code 1\n"
    "2026-12-07 11:00:00.003 UTC [2] LOG:  database system is shut down\n"
)


def test_the_fatal_lines_of_this_start_with_their_hint(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(EARLIER + THIS_START)
    assert why_not_started(log, since=len(EARLIER.encode())) == (
        'FATAL: logical replication slot "s" exists, but "wal_level" < "logical" '
        'HINT: Change "wal_level" to be "logical" or higher.'
    )


def test_without_a_fatal_line_the_last_lines_and_without_new_lines_says_so(
    tmp_path: Path,
) -> None:
    log = tmp_path / "server.log"
    log.write_text(EARLIER + "2026-12-07 11:00:00.000 UTC [2] LOG:  one\nLOG:  two\n")
    assert why_not_started(log, since=len(EARLIER.encode()), lines=1) == "LOG:  two"
    assert why_not_started(log, since=log.stat().st_size) == f"(it wrote nothing to {log})"
    assert why_not_started(tmp_path / "none.log") == f"(no log at {tmp_path / 'none.log'})"
