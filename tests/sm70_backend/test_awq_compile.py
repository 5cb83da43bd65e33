"""The AWQ W4A16 kernels (`awq_w4a16.cu`) compile for sm_70 (V100) and sm_90 (H200) on a CPU-only machine.

NVRTC 12.8 (the test requirement `nvidia-cuda-nvrtc-cu12`; NVRTC 13 refuses sm_70) compiles the
source; the checks read what came out (see test_kernel_compile.py for the disassembly route):
- sm_70 PTX has `mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32` (prefill); in the SASS the
  prefill kernel's hot loop is `HMMA.884.F32.F32.STEP0..3`, four per mma, 4 mma per 4-wide K step
  x 8 steps of a 32-row K tile = 32 mma; the decode kernel has no HMMA but dequantizes with f16x2
  arithmetic (`HADD2` / `HMUL2`) and accumulates with fp32 `FFMA`;
- no kernel spills registers or uses a stack frame (sm_70 and sm_90); the static shared memory
  fits a V100;
- sm_90: the same source compiles; m8n8k4 is emulated there (no HMMA.884).
"""

from __future__ import annotations

import functools
import os

import pytest

from sm70_backend.kernels import awq, codecheck, nvrtc
from sm70_backend.kernels.nvrtc import Compiled

NVRTC_12 = next((n for n in nvrtc.available_nvrtcs() if n.version[0] == 12), None)
if NVRTC_12 is None:
    reason = "no NVRTC 12.x (NVRTC 13 cannot target sm_70): install nvidia-cuda-nvrtc-cu12 or set VLLM_SM70_NVRTC_PATH"
    if os.environ.get("CI"):
        raise RuntimeError(reason)
    pytest.skip(reason, allow_module_level=True)

KERNELS = {"sm70_awq_gemv", "sm70_awq_reduce", "sm70_awq_gemm"}


@functools.cache
def compiled(arch: int) -> Compiled:
    return nvrtc.compile_source(nvrtc.kernel_source(awq.SOURCE_NAME), arch, {}, awq.SOURCE_NAME, NVRTC_12)


def test_sm70_prefill_kernel_uses_volta_tensor_cores_and_decode_dequantizes_in_registers() -> None:
    c = compiled(70)
    assert ".target sm_70" in c.ptx
    mma = c.ptx.count("mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32")
    assert mma == 32, mma  # (BK / 4) K steps x (BN / 16) column blocks, fully unrolled
    counts = codecheck.opcode_counts(codecheck.disassemble(c.cubin))
    assert set(counts) == KERNELS
    gemm = counts["sm70_awq_gemm"]
    steps = [gemm[f"HMMA.884.F32.F32.STEP{i}"] for i in range(4)]
    assert steps == [mma] * 4, steps
    gemv = counts["sm70_awq_gemv"]
    assert not any(op.startswith("HMMA") for op in gemv | counts["sm70_awq_reduce"])
    assert gemv["HADD2"] > 0 and gemv["HMUL2"] > 0 and gemv["FFMA"] >= 8 * awq.GEMV_MAX_M
    assert gemm["HADD2"] > 0 and gemm["HMUL2"] > 0  # the W tile is dequantized with f16x2 too
    usage = codecheck.resource_usage(c.log)
    assert set(usage) == KERNELS
    for kernel, report in usage.items():
        assert report["spill_stores"] == report["spill_loads"] == report["stack"] == 0, (kernel, report)
        assert report["registers"] <= 255
    # Static shared memory of the prefill kernel: x tile, W tile, row maps.
    assert 2 * (awq.BLOCK_M * (awq.BLOCK_K + 8) + awq.BLOCK_K * (awq.BLOCK_N + 8)) + 16 * awq.BLOCK_M <= 48 * 1024


def test_same_source_compiles_for_sm90_without_spills() -> None:
    c = compiled(90)
    assert ".target sm_90" in c.ptx and "mma.sync.aligned.m8n8k4" in c.ptx
    sass = codecheck.disassemble(c.cubin)
    assert "HMMA.884" not in sass  # emulated on sm_90: the H200 checks numerics, not V100 speed
    usage = codecheck.resource_usage(c.log)
    assert set(usage) == KERNELS
    assert all(r["spill_stores"] == r["spill_loads"] == 0 for r in usage.values()), usage
