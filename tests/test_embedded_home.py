"""Where the embedded server keeps its data: found from the project's root, so a script run from a
subdirectory joins the same server as the worker started at the root."""

from __future__ import annotations

from pathlib import Path

import pytest

from pgflow.app import default_data_dir


@pytest.mark.parametrize("marker", ["pyproject.toml", "setup.cfg", ".git"])
def test_the_data_directory_is_in_the_nearest_project_root_above(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marker: str,
) -> None:
    monkeypatch.delenv("PGFLOW_HOME", raising=False)
    root = tmp_path / "project"
    (root / "src" / "deep").mkdir(parents=True)
    (root / marker).mkdir() if marker == ".git" else (root / marker).write_text("")
    monkeypatch.chdir(root / "src" / "deep")
    assert default_data_dir() == root.resolve() / ".pgflow"
    monkeypatch.chdir(root)
    assert default_data_dir() == root.resolve() / ".pgflow"


def test_without_a_project_it_is_the_working_directory_and_pgflow_home_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGFLOW_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    markers = ("pyproject.toml", "setup.cfg", ".git")
    if any((d / m).exists() for d in (tmp_path, *tmp_path.parents) for m in markers):
        pytest.skip("the temporary directory lies inside a project")
    assert default_data_dir() == tmp_path.resolve() / ".pgflow"
    monkeypatch.setenv("PGFLOW_HOME", str(tmp_path / "elsewhere"))
    assert default_data_dir() == (tmp_path / "elsewhere").resolve()
