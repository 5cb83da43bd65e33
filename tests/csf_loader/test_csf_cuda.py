"""The CSF decode path on a CUDA GPU (skipped without one; benchmarks/csf_loader/gpu_session.py runs it).

* the library kernel and the exploration variants equal the torch reference bit for bit;
* the loader's device path (compressed streams to the GPU, checked and decoded there by the Triton
  kernel) yields the host path's tensors, on the GPU, and fails on every corrupt input with the host
  path's message; a real out-of-memory error names the tensor and the bytes it needed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run benchmarks/csf_loader/gpu_session.py on one)"
)


def run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600, check=False, cwd=HERE.parents[1]
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.parametrize("which", ["library", "variants"])
def test_kernels_match_reference_on_cuda(which: str) -> None:
    out = run(str(HERE / "triton_check.py"), *([] if which == "library" else ["--variants"]))
    assert f"device=cuda {which} cases=" in out and "mismatches=0" in out, out


def test_device_path_equals_host_path_on_cuda() -> None:
    out = run(str(HERE / "device_path_check.py"), "cuda")
    assert "device=cuda checks=" in out and "failures=0" in out, out
