"""The FastAPI recipe (examples/fastapi_app.py) against a real PostgreSQL: an async route
writes an order and its event in one transaction, and a route that fails after its
enqueue leaves neither."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from examples import fastapi_app
from outbox_kafka import configure, default_outbox
from tests.integration.test_enqueue import count_all, stored_events


@pytest.fixture
def kept_default_outbox() -> Iterator[None]:
    """The app configures the module-level outbox at startup: the one before is put back after."""
    previous = default_outbox()
    try:
        yield
    finally:
        configure(previous)


@pytest.fixture
def client(
    database_url: str, monkeypatch: pytest.MonkeyPatch, kept_default_outbox: None
) -> Iterator[TestClient]:
    """The example app on this test's database; its engine is disposed at shutdown."""
    monkeypatch.setenv("DATABASE_URL", database_url)
    with TestClient(fastapi_app.app, raise_server_exceptions=False) as test_client:
        yield test_client


def orders(engine: sa.Engine) -> list[tuple[str, str, int]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, customer_id, total_cents FROM fastapi_orders ORDER BY id")
        )
        return [(r.id, r.customer_id, r.total_cents) for r in rows]


def test_post_stores_the_order_and_its_event_together(
    client: TestClient, engine: sa.Engine
) -> None:
    response = client.post("/orders", json={"id": "o-1", "customer_id": "c-1", "total_cents": 1250})
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["id"] == "o-1"

    assert orders(engine) == [("o-1", "c-1", 1250)]
    [event] = stored_events(engine)
    assert str(event["event_id"]) == body["event_id"]
    assert (event["ordering_key"], event["seq"], event["topic"], event["type"]) == (
        "o-1",
        1,
        "orders",
        "order.created",
    )
    assert json.loads(event["value"])["source"] == "//shop/orders-service"


def test_a_route_failing_after_enqueue_stores_neither(
    client: TestClient, engine: sa.Engine
) -> None:
    ok = client.post("/orders", json={"id": "o-1", "customer_id": "c-1", "total_cents": 100})
    assert ok.status_code == 201
    failed = client.post(
        "/orders/fail-after-enqueue", json={"id": "o-2", "customer_id": "c-2", "total_cents": 200}
    )
    assert failed.status_code == 500
    assert orders(engine) == [("o-1", "c-1", 100)]
    assert [e["ordering_key"] for e in stored_events(engine)] == ["o-1"]
    assert count_all(engine) == (1, 1, 1)


def test_the_failing_route_raises_in_the_application(
    database_url: str, kept_default_outbox: None
) -> None:
    """Without the test client's 500: the exception is the example's own, from inside the
    transaction block (so the rollback above is the block's doing, not the client's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DATABASE_URL", database_url)
        with (
            TestClient(fastapi_app.app) as test_client,
            pytest.raises(fastapi_app.PaymentServiceDown, match="o-3"),
        ):
            test_client.post(
                "/orders/fail-after-enqueue",
                json={"id": "o-3", "customer_id": "c-3", "total_cents": 300},
            )
