"""The compose stack's orders service (deploy/producer/orders.py) against a real database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parent.parent.parent
SCRIPT = REPO / "deploy" / "producer" / "orders.py"
STEPS = ["order.created", "order.paid", "order.shipped"]


def run_orders(*args: str, database_url: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "DEMO_"))}
    if database_url is not None:
        env["OUTBOX_DATABASE_URL"] = database_url
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_orders_service_writes_each_order_through_its_steps_in_order(
    engine: sa.Engine, database_url: str
) -> None:
    result = run_orders("--orders", "7", "--rate", "500", "--seed", "3", database_url=database_url)
    assert result.returncode == 0, result.stderr

    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT ordering_key, seq, type, topic, status FROM outbox ORDER BY 1, 2")
        ).all()
        orders = dict(conn.execute(sa.text("SELECT order_id, status FROM demo_orders")).all())
    assert len(rows) == 7 * len(STEPS)
    by_key: dict[str, list[str]] = {}
    for row in rows:
        assert row.topic == "orders"
        assert row.status == "pending"
        by_key.setdefault(row.ordering_key, []).append(row.type)
    assert set(by_key) == set(orders)
    assert all(types == STEPS for types in by_key.values())
    assert set(orders.values()) == {"shipped"}
    assert "writing orders to" in result.stderr


def test_orders_service_keeps_the_database_password_out_of_its_output(database_url: str) -> None:
    # The test servers trust local connections, so any password gets in.
    url = make_url(database_url).set(password="pw-not-for-logs").render_as_string(False)
    result = run_orders("--orders", "1", "--rate", "500", database_url=url)
    assert result.returncode == 0, result.stderr
    assert "writing orders to" in result.stderr
    assert "pw-not-for-logs" not in result.stderr + result.stdout


def test_orders_service_without_a_database_url_says_so() -> None:
    result = run_orders("--orders", "1", database_url=None)
    assert result.returncode == 2
    assert "OUTBOX_DATABASE_URL" in result.stderr
    assert "Traceback" not in result.stderr
