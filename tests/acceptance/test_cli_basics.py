"""What every ``outbox-kafka`` command does alike: ``--version``, and output into a closed pipe."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from outbox_kafka import __version__
from tests.support import libpq_url

CLI = [sys.executable, "-m", "outbox_kafka.cli"]
SCRIPT = os.path.join(os.path.dirname(sys.executable), "outbox-kafka")


def _env(database_url: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    if database_url is not None:
        env["OUTBOX_DATABASE_URL"] = libpq_url(database_url)
    return env


@pytest.mark.parametrize("command", [CLI, [SCRIPT]], ids=["python -m", "script"])
def test_version_prints_the_package_version(command: list[str]) -> None:
    result = subprocess.run(
        [*command, "--version"], capture_output=True, text=True, env=_env(), timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"outbox-kafka {version('outbox-kafka')}\n"
    assert __version__ == version("outbox-kafka")


def _into_closed_pipe(
    args: list[str], database_url: str | None
) -> subprocess.CompletedProcess[str]:
    """Run the command with its stdout a pipe whose reader has gone (``| head`` after
    its lines, ``| true``): every write fails."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [*CLI, *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(database_url),
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "args",
    [["stats"], ["stats", "--json"], ["check", "--consistency"], ["purge", "--dry-run"]],
    ids=" ".join,
)
def test_a_reader_that_goes_away_ends_the_command_quietly(
    args: list[str], database_url: str
) -> None:
    result = _into_closed_pipe(args, database_url)
    assert result.stderr == ""
    assert result.returncode == 141  # 128 + SIGPIPE, as a shell reports `yes | head`
