"""The page convention: what the docs test runs, writes, skips and shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from .pages import PageError, read_blocks


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_blocks_are_run_written_skipped_or_shown(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "# Page\n\n```python\nx = 1\n```\n\n```python\n# shop/apps.py\nA = 1\n```\n\n"
        "```toml\n# outboxes.toml\n[a]\n```\n\n"
        "<!-- not run: needs a Kubernetes cluster -->\n```sh\nkubectl apply -f x\n```\n\n"
        "```console\n$ outbox-kafka check\nOK   database\n```\n\n```text\noutput\n```\n",
    )
    blocks = read_blocks(page)
    assert [(b.action, b.path, b.reason) for b in blocks] == [
        ("run", None, None),
        ("write", "shop/apps.py", None),
        ("write", "outboxes.toml", None),
        ("skip", None, "needs a Kubernetes cluster"),
        ("shell", None, None),
        ("show", None, None),
    ]
    assert blocks[4].shell_script() == "outbox-kafka check\n"
    assert blocks[0].where == "page.md:3"  # the opening fence


@pytest.mark.parametrize(
    "text",
    [
        "<!-- not run -->\n```sh\nkubectl get pods\n```\n",
        "<!-- not run: -->\n```sh\nkubectl get pods\n```\n",
        "<!-- not run: a reason -->\nsome prose\n```sh\nkubectl get pods\n```\n",
        "```python\nx = 1\n",
    ],
    ids=["no-reason", "empty-reason", "not-before-a-block", "unclosed"],
)
def test_a_page_breaking_the_convention_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(PageError):
        read_blocks(_page(tmp_path, text))
