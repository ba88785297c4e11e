"""Producers in the shapes applications have: a ``scoped_session``, Flask-SQLAlchemy's
``db.session``, and async sessions (refused with the way to call from async code)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import scoped_session, sessionmaker

from outbox_kafka import Outbox, UnsafeConnection
from tests.integration.test_enqueue import stored_events
from tests.support import valid_event


def test_a_scoped_session_writes_in_its_current_sessions_transaction(
    engine: sa.Engine, outbox: Outbox
) -> None:
    session = scoped_session(sessionmaker(bind=engine))
    try:
        outbox.enqueue(session, **valid_event(key="kept"))
        session.commit()
        outbox.enqueue(session, **valid_event(key="dropped"))
        session.rollback()
    finally:
        session.remove()
    assert [e["ordering_key"] for e in stored_events(engine)] == ["kept"]


def test_flask_sqlalchemy_db_session_commits_and_rolls_back_with_the_view(
    engine: sa.Engine, outbox: Outbox
) -> None:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = engine.url.render_as_string(hide_password=False)
    db = SQLAlchemy(app)

    class Order(db.Model):  # type: ignore[name-defined,misc]
        __tablename__ = "flask_orders"
        id = db.Column(db.Text, primary_key=True)

    with app.app_context():
        db.create_all()

    @app.post("/orders/<order_id>")
    def create_order(order_id: str) -> Any:
        db.session.add(Order(id=order_id))
        outbox.enqueue(db.session, **valid_event(key=order_id))
        if order_id.startswith("fail"):
            raise RuntimeError("the view failed after enqueue")
        db.session.commit()
        return {"id": order_id}, 201

    client = app.test_client()
    assert client.post("/orders/o-1").status_code == 201
    app.config["PROPAGATE_EXCEPTIONS"] = False
    assert client.post("/orders/fail-1").status_code == 500
    assert [e["ordering_key"] for e in stored_events(engine)] == ["o-1"]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id FROM flask_orders")).scalars().all() == ["o-1"]
    with app.app_context():
        db.engine.dispose()


def test_an_async_session_given_to_the_sync_api_is_refused_naming_the_async_one(
    outbox: Outbox,
) -> None:
    with pytest.raises(UnsafeConnection) as caught:
        outbox.enqueue(AsyncSession(), **valid_event())  # type: ignore[arg-type]
    assert "AsyncSession given: enqueue and enqueue_many take a synchronous" in str(caught.value)
    assert "await enqueue_async(...) or await enqueue_many_async(...)" in str(caught.value)
