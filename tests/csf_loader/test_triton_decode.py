"""The Triton decode kernels equal the torch reference bit for bit (interpreter on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("triton_check.py")


@pytest.mark.parametrize("which", ["library", "variants"])
def test_triton_kernels_match_reference_under_interpreter(which: str) -> None:
    # TRITON_INTERPRET is read when the kernel is decorated, so the check runs in a fresh process.
    # "library": csf_loader.triton_decode (what the loader runs); "variants": the exploration
    # variants of benchmarks/csf_loader/decode_variants.py.
    env = dict(os.environ, TRITON_INTERPRET="1")
    args = [] if which == "library" else ["--variants"]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{which} cases=" in result.stdout and "mismatches=0" in result.stdout, result.stdout


def test_library_kernel_modules_import_without_vllm() -> None:
    code = (
        "import sys, csf_loader.triton_decode, csf_loader.codec, csf_loader.device_decode\n"
        "assert 'vllm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
