"""The repository's own folders never take the import name of a package the engines import.

A script run as ``python DIR/script.py`` has DIR first on ``sys.path``, so a folder in DIR named
like a top-level package shadows that package for the script and every engine process it starts.
``tests/qwen38_plugin/cuda`` (now ``on_cuda``) did so to NVIDIA's ``cuda`` namespace: on an H100
with FlashInfer installed (2026-12-06), every engine that ``tests/qwen38_plugin/qwen38_engine_greedy.py``
started failed in FlashInfer's import with "No module named 'cuda.bindings'".
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = {"qwen38_plugin", "sm70_backend", "dflash2", "csf_loader", "tool_parsers"}  # tests/<plugin> mirrors them
# Imported on GPUs only, so not installed here: NVIDIA's cuda-python namespace, the CUTLASS DSL,
# FlashInfer, quack, tilelang, flash-linear-attention.
GPU_PACKAGES = {"cuda", "cutlass", "flashinfer", "quack", "tilelang", "nvidia", "fla"}


def script_folders() -> set[Path]:
    """Every folder under tests/, benchmarks/ and scripts/ holding a script meant to be run by path."""
    folders = set()
    for top in ("tests", "benchmarks", "scripts"):
        for path in (ROOT / top).rglob("*.py"):
            if "__pycache__" not in path.parts and '__name__ == "__main__"' in path.read_text():
                folders.add(path.parent)
    return folders


def test_no_folder_beside_a_script_shadows_an_installed_or_gpu_package() -> None:
    packages = (set(importlib.metadata.packages_distributions()) | GPU_PACKAGES) - OURS
    assert "torch" in packages and "cuda" in packages  # the list is the installed one
    folders = script_folders()
    assert ROOT / "tests/qwen38_plugin" in folders, "no script folder found: the scan is broken"
    shadowing = sorted(
        str(sub.relative_to(ROOT))
        for folder in folders
        for sub in folder.iterdir()
        if sub.is_dir() and sub.name in packages
    )
    assert not shadowing, f"rename these folders (scripts beside them import them instead of the package): {shadowing}"
