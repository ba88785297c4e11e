"""Reading a documentation page into the blocks the docs test runs, writes or leaves alone.

The convention (docs/development.md, "Runnable pages"):

- ```python blocks run in order, in one namespace per page;
- a block of any language whose first line is a comment naming a file
  (``# shop/apps.py``, ``# outboxes.toml``, ``-- grants.sql``) is written to that
  path in the page's project directory instead;
- ```sh / ```bash / ```shell blocks run as one shell script each in that
  directory; ```console blocks run their ``$ `` lines only;
- a block right after ``<!-- not run: <reason> -->`` is not run, and the
  reason is required;
- every other block (```text, bare ```, ```json, ...) is shown, not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

RUN_LANGUAGES = {"python", "py"}
SHELL_LANGUAGES = {"sh", "bash", "shell", "console"}
_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not run(?P<colon>:)?\s*(?P<reason>.*?)\s*-->\s*$")
_FILE_COMMENT = re.compile(r"^(?:#|--|//)\s*(?P<path>[\w][\w./-]*\.[A-Za-z0-9]+)\s*$")


class PageError(ValueError):
    """A page breaks the convention (a marker without a reason, an unclosed fence...)."""


@dataclass(frozen=True)
class Block:
    """One fenced block: ``action`` is run, shell, write, skip or show."""

    page: str
    line: int
    language: str
    text: str
    action: str
    path: str | None = None
    reason: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def shell_script(self) -> str:
        """The commands of a shell block (``$ `` lines only for ```console)."""
        if self.language != "console":
            return self.text
        return "".join(line[2:] + "\n" for line in self.text.splitlines() if line.startswith("$ "))


def read_blocks(path: Path, root: Path | None = None) -> list[Block]:
    """The page's fenced blocks in order, each with what the test does with it."""
    name = str(path.relative_to(root)) if root else path.name
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    pending_reason: str | None = None
    marker_line = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _NOT_RUN.match(line.strip())
        if marker:
            reason = marker.group("reason")
            if not marker.group("colon") or not reason:
                raise PageError(f"{name}:{i + 1}: '<!-- not run -->' needs a reason after a colon")
            pending_reason, marker_line = reason, i + 1
            i += 1
            continue
        fence = _FENCE.match(line)
        if not fence:
            if line.strip() and pending_reason is not None:
                raise PageError(f"{name}:{marker_line}: a 'not run' marker must precede a block")
            i += 1
            continue
        ticks, language = fence.group(1), fence.group(2).lower()
        start = i + 1
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != ticks:
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise PageError(f"{name}:{start}: the block is never closed")
        i += 1
        text = "\n".join(body) + "\n"
        blocks.append(_classify(name, start, language, text, pending_reason))
        pending_reason = None
    if pending_reason is not None:
        raise PageError(f"{name}:{marker_line}: a 'not run' marker must precede a block")
    return blocks


def _classify(name: str, line: int, language: str, text: str, reason: str | None) -> Block:
    if reason is not None:
        return Block(name, line, language, text, "skip", reason=reason)
    first = text.split("\n", 1)[0].strip()
    named = _FILE_COMMENT.match(first)
    if named and language not in ("sh", "bash", "shell", "console", "text", ""):
        return Block(name, line, language, text, "write", path=named.group("path"))
    if language in RUN_LANGUAGES:
        return Block(name, line, language, text, "run")
    if language in SHELL_LANGUAGES:
        return Block(name, line, language, text, "shell")
    return Block(name, line, language, text, "show")
