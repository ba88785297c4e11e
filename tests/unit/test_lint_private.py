"""The lint that keeps tests out of other objects' private names (tests/lint_private.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.lint_private import check, findings


def found(code: str) -> list[str]:
    return [what for _, what in findings(ast.parse(code))]


@pytest.mark.parametrize(
    "code",
    [
        "relay._record = counting",
        "x = outbox._writer",
        "self.relay._release(claim)",
        "from outbox_kafka.relay.store import _ValueNotText",
        "from outbox_kafka._hidden import thing",
        "import outbox_kafka._hidden",
        "monkeypatch.setattr(module, '_default', None)",
        "getattr(store, '_keys')",
        "monkeypatch.setattr('outbox_kafka.relay.loop._wait', None)",
        "mock.patch('outbox_kafka.relay._thing')",
    ],
)
def test_a_reach_into_another_objects_private_name_is_found(code: str) -> None:
    assert found(code), code


@pytest.mark.parametrize(
    "code",
    [
        "self._stop.set()",
        "cls._cache = {}",
        "super()._setup()",
        "row._replace(seq=2)",
        "point._asdict()",
        "KafkaError._PARTITION_EOF",
        "os._exit(1)",
        "obj.__class__",
        "from __future__ import annotations",
        "setattr(self, '_x', 1)",
        "relay.metrics",
    ],
)
def test_own_and_public_names_pass(code: str) -> None:
    assert found(code) == [], code


def test_check_names_the_file_and_line(tmp_path: Path) -> None:
    test_file = tmp_path / "test_x.py"
    test_file.write_text("def test() -> None:\n    assert relay._other\n")
    assert check([tmp_path], tmp_path) == [
        "test_x.py:2: relay._other: a private name of another object"
    ]
