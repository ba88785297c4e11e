"""``python -m bench --output``: its folder is made, or a bad one refused before any
section runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.__main__ import main, prepare_output


def test_a_missing_folder_is_made(tmp_path: Path) -> None:
    results = tmp_path / "new" / "deeper" / "results.md"
    assert prepare_output(results) is None
    assert results.parent.is_dir()


def test_a_folder_given_as_the_file_is_refused(tmp_path: Path) -> None:
    problem = prepare_output(tmp_path)
    assert problem is not None and "is a folder" in problem and "results.md" in problem


def test_a_folder_under_a_file_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "plain-file"
    blocker.write_text("x")
    problem = prepare_output(blocker / "results.md")
    assert problem is not None and "cannot make the folder" in problem


def test_the_bench_refuses_a_bad_output_before_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "plain-file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as exited:
        main(["--only", "producer", "--output", str(blocker / "results.md")])
    assert exited.value.code == 2
    assert "--output: cannot make the folder" in capsys.readouterr().err
