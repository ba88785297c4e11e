"""`outbox-kafka demo`, the command `make demo` runs, as a separate process."""

from __future__ import annotations

import os
import re
import subprocess
import sys

CLI = [sys.executable, "-m", "outbox_kafka.cli"]

#: Words a passing run never prints: a reader takes any of them for a failure.
ALARMS = re.compile(r"\bFAIL\b|\bERROR\b|Traceback|warning", re.IGNORECASE)


def test_a_passing_demo_prints_no_failure_error_or_warning() -> None:
    # As on a fresh machine or in a container: no XDG_RUNTIME_DIR, no OUTBOX_* settings.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OUTBOX_") and k != "XDG_RUNTIME_DIR"
    }
    result = subprocess.run(
        [*CLI, "demo", "--orders", "60", "--writers", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert re.search(r"^  result +PASS$", result.stdout, re.MULTILINE), output
    alarming = [line for line in output.splitlines() if ALARMS.search(line)]
    assert alarming == [], output
