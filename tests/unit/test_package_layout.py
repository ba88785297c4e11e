"""The package's shape: unique module names, no import cycles, no arrow into the root or
across rooms. Read from the source (imports under ``TYPE_CHECKING`` count too), so a
module needs not be importable for its arrows to be seen."""

from __future__ import annotations

import ast
from collections import Counter
from functools import cache
from pathlib import Path

import outbox_kafka

PACKAGE = Path(outbox_kafka.__file__).parent
ROOT = "outbox_kafka"

#: Rooms every room may import: the shared modules at the top level, and the schema.
SHARED = {"", "schema"}
#: What each room may import from the other rooms, beyond the shared ones. ``cli`` and
#: ``demo`` sit on top and may import any room; the top level's re-exports of moved
#: names (``settings.py``, ``http_server.py``) and ``testing.py`` are not checked.
ALLOWED_ACROSS: dict[str, set[str]] = {
    "producer": set(),
    "relay": set(),
    "schema": set(),
    "contrib": {"producer"},
    # the relay's retention defaults (so purge and relay agree), its report of what
    # is left (so stats and a drain count alike), and its pgoutput decoder (so check
    # reads the slot's stream as the relay does)
    "operations": {"relay.config", "relay.batch", "relay.pgoutput"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str) -> set[str]:
    """The package's modules ``module`` imports; ``from p import m`` of a submodule
    counts as ``p.m``, of any other name as ``p``."""
    path = _modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            submodules = {f"{source}.{a.name}" for a in node.names} & _modules().keys()
            found.update(submodules or {source})
    return {name for name in found if name in _modules() and name != module}


def _room(module: str) -> str:
    """``producer``, ``relay``, ... for a subpackage's module, ``""`` for a top-level one."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else ""


def test_no_two_modules_share_a_name() -> None:
    names = Counter(
        p.name for p in _modules().values() if p.name not in {"__init__.py", "__main__.py"}
    )
    assert [name for name, count in names.items() if count > 1] == []


def test_no_module_imports_the_package_root() -> None:
    """The root re-exports the public names; a module inside imports each where it lives."""
    upward = sorted(m for m in _modules() if m != ROOT and ROOT in _imports(m))
    assert upward == []


def test_rooms_import_only_what_they_are_allowed_across() -> None:
    crossing = []
    for module in _modules():
        room = _room(module)
        if room not in ALLOWED_ACROSS:
            continue
        allowed = ALLOWED_ACROSS[room]
        for target in _imports(module):
            other = _room(target)
            short = target.removeprefix(f"{ROOT}.")
            if other in SHARED or other == room or other in allowed or short in allowed:
                continue
            crossing.append(f"{module} -> {target}")
    assert sorted(crossing) == []


def test_no_import_cycles() -> None:
    graph = {m: _imports(m) for m in _modules()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert cycles == []
