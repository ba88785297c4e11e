"""The contract suite's one fixture: each test runs once per store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from tests.contract.stores import StoreUnderTest, memory, postgres


@pytest.fixture(params=["postgresql", "memory"])
def under_test(request: pytest.FixtureRequest) -> Iterator[StoreUnderTest]:
    """The relay's ``Store`` on a fresh database, then ``InMemoryStore``: the same
    assertions hold for both."""
    if request.param == "postgresql":
        engine: sa.Engine = request.getfixturevalue("engine")
        database_url: str = request.getfixturevalue("database_url")
        yield from postgres(engine, database_url)
    else:
        yield from memory()
