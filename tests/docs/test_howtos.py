"""Every how-to page (and the quickstart) runs, block by block, against the local stack.

The convention is in docs/development.md ("Runnable pages") and tests/docs/pages.py.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

from .conftest import COUNTS, DocsStack, PageCounts, repo_root
from .pages import Block, read_blocks

DOCS = repo_root() / "docs"
# The pages made runnable so far; every page of docs/howto belongs here.
PAGES = [
    DOCS / "howto" / f"{name}.md"
    for name in (
        "dead-letters",
        "retention",
        "testing",
        "alembic",
        "tracing",
        "upgrading",
        "flask",
        "fastapi",
        "django",
        "operating",
        "security",
        "several-outboxes",
        "log-mode",
    )
]
PAGES.append(DOCS / "quickstart.md")  # the quickstart, at the top of docs/
SHELL_TIMEOUT = 120
OPENING = "outbox-kafka dev"
# Variables bash sets for itself; they are not a page's exports.
_SHELL_OWN = {"_", "SHLVL", "PWD", "OLDPWD"}


def _page_environment(database_url: str, stack: DocsStack) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_DATABASE_URL"] = database_url
    env["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"] = stack.bootstrap
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _write(block: Block, project: Path) -> None:
    assert block.path is not None
    target = project / block.path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(block.text)


def _run_python(block: Block, namespace: dict[str, object]) -> None:
    code = compile(block.text, block.where, "exec")
    try:
        exec(code, namespace)  # the page's own code, as a reader runs it
    except Exception:
        pytest.fail(f"{block.where}: the python block failed:\n{traceback.format_exc()}")


def _run_shell(block: Block, project: Path, env: dict[str, str]) -> dict[str, str]:
    """Runs the block; returns the environment it leaves, its exports included."""
    script = block.shell_script()
    with tempfile.TemporaryDirectory() as scratch:
        left = Path(scratch) / "environment"
        result = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", f"{script}env -0 > {shlex.quote(str(left))}\n"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=SHELL_TIMEOUT,
            check=False,
        )
        if result.returncode != 0:
            pytest.fail(
                f"{block.where}: the {block.language} block exited {result.returncode}:\n"
                f"{script}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
            )
        if not left.exists():  # the block ended with an `exit 0` of its own
            return dict(env)
        entries = (entry.partition("=") for entry in left.read_text().split("\0") if entry)
        return {name: value for name, _, value in entries if name not in _SHELL_OWN}


def _carry_exports(
    left: dict[str, str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a shell block exported stays set for the page's later blocks, as in one terminal."""
    for name, value in left.items():
        if env.get(name) != value:
            env[name] = value
            monkeypatch.setenv(name, value)
    for name in [n for n in env if n not in left and n.isidentifier()]:
        del env[name]
        monkeypatch.delenv(name, raising=False)


def _forget_modules(names: set[str], project: Path) -> None:
    """Modules the page wrote (its app, its settings) must not leak into the next page.

    A directory without ``__init__.py`` (a namespace package) has a ``__path__``, no
    ``__file__``.
    """
    for name in names:
        module = sys.modules[name]
        places = [getattr(module, "__file__", None) or "", *getattr(module, "__path__", [])]
        if any(str(place).startswith(str(project)) for place in places):
            del sys.modules[name]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
@pytest.mark.usefixtures("checkout_files")
def test_page_runs_in_order(
    page: Path,
    docs_stack: DocsStack,
    page_database: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocks = read_blocks(page, DOCS)
    opening = page.read_text().split("\n## ", 1)[0]
    assert OPENING in opening, f"{page.name} does not start from `{OPENING}`"
    env = _page_environment(page_database, docs_stack)
    for name in [k for k in os.environ if k.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)
    for name in ("OUTBOX_DATABASE_URL", "OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "PATH"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    counts = PageCounts(page=str(page.relative_to(DOCS)))
    COUNTS.append(counts)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    try:
        for block in blocks:
            if block.action == "write":
                _write(block, tmp_path)
                counts.written += 1
            elif block.action == "run":
                _run_python(block, namespace)
                counts.ran += 1
            elif block.action == "shell":
                _carry_exports(_run_shell(block, tmp_path, env), env, monkeypatch)
                counts.ran += 1
            elif block.action == "skip":
                counts.skipped.append(f"{block.where}: {block.reason}")
            else:
                counts.shown += 1
    finally:
        _forget_modules(set(sys.modules) - before, tmp_path)
    assert counts.ran + counts.written > 0, f"{page.name} has no block that runs"


def test_the_modules_a_page_wrote_are_forgotten_namespace_packages_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "shop").mkdir()  # no __init__.py: a namespace package
    (tmp_path / "shop" / "models.py").write_text("ORDER = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    import shop.models  # type: ignore[import-not-found]  # noqa: F401

    _forget_modules(set(sys.modules) - before, tmp_path)
    assert not {"shop", "shop.models"} & set(sys.modules)


def test_what_a_shell_block_exports_stays_set_for_the_next_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCS_GONE", "1")
    env = {**os.environ, "DOCS_KEPT": "1"}
    block = Block(
        "page.md", 1, "sh", "export DOCS_URL=postgresql://x/y\nunset DOCS_GONE\n", "shell"
    )
    _carry_exports(_run_shell(block, tmp_path, env), env, monkeypatch)
    assert (env["DOCS_URL"], env["DOCS_KEPT"], "DOCS_GONE" in env) == (
        "postgresql://x/y",
        "1",
        False,
    )
    assert os.environ["DOCS_URL"] == "postgresql://x/y" and "DOCS_GONE" not in os.environ
    echo = Block("page.md", 5, "sh", 'test "$DOCS_URL" = postgresql://x/y\n', "shell")
    _run_shell(echo, tmp_path, env)
