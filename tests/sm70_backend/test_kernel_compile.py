"""FLASH_ATTN_V100's CUDA kernels compile for sm_70 (V100) and sm_90 (H200) on a CPU-only machine.

NVRTC 12.8 (PyPI `nvidia-cuda-nvrtc-cu12`, a test requirement: NVRTC 13 refuses sm_70) compiles
`flash_v100.cu` for every supported head size; the checks read what came out:
- PTX: the Volta tensor-core instruction `mma.sync.aligned.m8n8k4` in both forms the attention
  kernel uses (`.row.col` for Q K^T, `.row.row` for P V);
- sm_70 SASS (Triton's nvdisasm, the cubin relabelled sm_75, see `codecheck`): the attention
  kernel's hot loop is `HMMA.884.F32.F32.STEP0..3`, four per mma, and no kernel spills registers
  or uses a stack; shared memory fits a V100 (96 KiB per block);
- sm_90: the same source compiles (the H200 runs the numerics tests); there the m8n8k4 instruction
  is emulated (calls to `__cuda_sm_8x_mma_*`, no HMMA), so H200 timings say nothing of V100 speed.
Each compile takes about a second; they are made once per module.
"""

from __future__ import annotations

import functools
import os
import re

import pytest

from sm70_backend.kernels import attention, codecheck, nvrtc
from sm70_backend.kernels.nvrtc import Compiled


def _nvrtc_12() -> nvrtc.Nvrtc | None:
    return next((n for n in nvrtc.available_nvrtcs() if n.version[0] == 12), None)


if _nvrtc_12() is None:
    reason = (
        "no NVRTC 12.x (NVRTC 13 cannot target sm_70): `pip install -c constraints.txt nvidia-cuda-nvrtc-cu12` "
        "(a test requirement of requirements-dev.txt) or set VLLM_SM70_NVRTC_PATH"
    )
    if os.environ.get("CI"):
        raise RuntimeError(reason)  # CI installs requirements-dev.txt: never skip there
    pytest.skip(reason, allow_module_level=True)


@functools.cache
def compiled(arch: int, head_size: int) -> Compiled:
    return nvrtc.compile_source(
        nvrtc.kernel_source(attention.SOURCE_NAME), arch, {"HEAD_DIM": head_size}, attention.SOURCE_NAME, _nvrtc_12()
    )


@pytest.mark.parametrize("head_size", attention.SUPPORTED_HEAD_SIZES)
def test_sm70_attention_kernels_use_volta_tensor_cores(head_size: int) -> None:
    c = compiled(70, head_size)
    assert ".target sm_70" in c.ptx
    row_col = c.ptx.count("mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32")
    row_row = c.ptx.count("mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32")
    assert row_col > 0 and row_row > 0
    counts = codecheck.opcode_counts(codecheck.disassemble(c.cubin))
    assert set(counts) == {"sm70_flash_attention", "sm70_write_kv", "sm70_merge_splits"}
    hot = counts["sm70_flash_attention"]
    steps = [hot[f"HMMA.884.F32.F32.STEP{i}"] for i in range(4)]
    assert steps[0] == row_col + row_row and len(set(steps)) == 1, steps  # each mma: four HMMA steps
    assert not any(op.startswith("HMMA") for op in counts["sm70_write_kv"] | counts["sm70_merge_splits"])
    usage = codecheck.resource_usage(c.log)
    for kernel, report in usage.items():
        assert report["spill_stores"] == report["spill_loads"] == report["stack"] == 0, (kernel, report)
    assert usage["sm70_flash_attention"]["registers"] <= 255
    assert attention.shared_bytes(head_size) <= 96 * 1024


@pytest.mark.parametrize("head_size", [128, 256])
def test_same_source_compiles_for_sm90(head_size: int) -> None:
    c = compiled(90, head_size)
    assert ".target sm_90" in c.ptx and "mma.sync.aligned.m8n8k4" in c.ptx
    sass = codecheck.disassemble(c.cubin)
    assert "HMMA.884" not in sass
    assert set(re.findall(r"__cuda_sm_8x_mma_row_(?:col|row)_f32_f16_f16_f32", sass)) == {
        "__cuda_sm_8x_mma_row_col_f32_f16_f16_f32",
        "__cuda_sm_8x_mma_row_row_f32_f16_f16_f32",
    }
    usage = codecheck.resource_usage(c.log)
    assert all(r["spill_stores"] == 0 for r in usage.values()), usage


def test_nvrtc_13_is_refused_for_sm70_with_the_fix_named(monkeypatch: pytest.MonkeyPatch) -> None:
    thirteen = [n for n in nvrtc.available_nvrtcs() if n.version[0] == 13]
    monkeypatch.setattr(nvrtc, "available_nvrtcs", lambda: tuple(thirteen))
    with pytest.raises(nvrtc.NvrtcError, match=r"no NVRTC library compiles for sm_70.*nvidia-cuda-nvrtc-cu12"):
        nvrtc.nvrtc_for(70)


def test_compile_cache_reuses_the_cubin(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_SM70_KERNEL_CACHE", str(tmp_path))
    source = nvrtc.kernel_source(attention.SOURCE_NAME)
    first = nvrtc.compile_cached(source, 70, {"HEAD_DIM": 64}, attention.SOURCE_NAME)
    (cached,) = tmp_path.glob("flash_v100-sm70-*.cubin")
    again = nvrtc.compile_cached(source, 70, {"HEAD_DIM": 64}, attention.SOURCE_NAME)
    assert again.log == "(cached)" and again.cubin == first.cubin == cached.read_bytes()
    other = nvrtc.compile_cached(source + "\n", 70, {"HEAD_DIM": 64}, attention.SOURCE_NAME)
    assert other.log != "(cached)"  # another source, another key
