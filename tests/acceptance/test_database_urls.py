"""Every command and the relay take the application's own database URL, whatever its
driver (``postgresql+psycopg://``, ``postgresql+asyncpg://``): they connect with
psycopg2; a parameter only another driver knows is refused at once, naming it."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from tests.acceptance.test_operator_cli import RELAY_TIMING, REPO, as_json, ok, run_cli
from tests.relay_support import consume_all, enqueue_bulk, seq_events, topic_outbox

DRIVERS = ("psycopg", "asyncpg")


def _with_driver(database_url: str, driver: str) -> str:
    url = make_url(database_url).set(drivername=f"postgresql+{driver}")
    return url.render_as_string(hide_password=False)


@pytest.mark.parametrize("driver", DRIVERS)
def test_every_command_runs_on_an_application_url(
    driver: str,
    empty_database: Callable[[], str],
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    url = _with_driver(empty_database(), driver)
    env = {"OUTBOX_DATABASE_URL": url}
    assert "applied" in ok("migrate", **env)
    topic = new_topic(1)
    engine = sa.create_engine(make_url(url).set(drivername="postgresql+psycopg2"))
    try:
        ids = enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["a", "b"], 6))
    finally:
        engine.dispose()
    assert as_json("stats", **env)["totals"]["pending"] == 6
    checked = as_json(
        "check",
        "--check-timeout",
        "3",
        "--bootstrap-servers",
        kafka_bootstrap,
        "--schema-dir",
        str(REPO / "schemas" / "events"),
        **env,
    )
    assert checked["ok"], checked
    drained = ok("relay", "--drain", "--bootstrap-servers", kafka_bootstrap, *RELAY_TIMING, **env)
    assert "drained: 6 delivered, 0 discarded" in drained
    records = consume_all(kafka_bootstrap, topic, 6)
    assert sorted(r.event_id for r in records) == sorted(ids)
    assert as_json("requeue", "--all", "--dry-run", **env)["count"] == 0
    assert as_json("unpark", "--all", "--dry-run", **env)["count"] == 0
    assert as_json("purge", "--dry-run", **env)["dry_run"] is True
    assert as_json("check", "--consistency", **env)["ok"]


@pytest.mark.parametrize(
    "command",
    [
        ["migrate"],
        ["stats"],
        ["check", "--bootstrap-servers", "127.0.0.1:1"],
        ["relay", "--drain", "--bootstrap-servers", "127.0.0.1:1"],
        ["requeue", "--all"],
        ["unpark", "--all"],
        ["purge"],
    ],
    ids=lambda c: c[0],
)
def test_a_parameter_of_another_driver_is_refused_at_once_naming_it(
    command: list[str], database_url: str
) -> None:
    parsed = make_url(_with_driver(database_url, "asyncpg")).update_query_dict({"ssl": "require"})
    url = parsed.render_as_string(hide_password=False)
    started = time.monotonic()
    result = run_cli(*command, OUTBOX_DATABASE_URL=url)
    # check lists every problem (exit status 1); the other commands stop at once (2).
    assert result.returncode == (1 if command[0] == "check" else 2), result.stdout + result.stderr
    assert "'ssl' is not a libpq parameter" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 30
