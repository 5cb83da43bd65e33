"""The Triton decode kernel equals the torch reference bit for bit (interpreter on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("triton_check.py")


def test_triton_kernel_matches_reference_under_interpreter() -> None:
    # TRITON_INTERPRET is read when the kernel is decorated, so the check runs in a fresh process.
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cases=" in result.stdout and "mismatches=0" in result.stdout, result.stdout


def test_triton_module_imports_without_vllm() -> None:
    code = "import sys, csf_loader.triton_decode, csf_loader.codec; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
