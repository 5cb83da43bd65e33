"""The plain-torch reference of FLASH_ATTN_V100 (the kernels' oracle and the CPU path) against
torch's scaled_dot_product_attention on the same K/V laid out densely.

Each case draws fresh random inputs, writes the new tokens' K/V through the reference's cache
write (unused blocks hold NaN, so a read outside a request's blocks shows), and compares each
request's rows with SDPA (fp64 on CPU) over its whole sequence: causal prefill, chunked prefill
with a cached context, decode, sliding windows, non-causal block attention (DFlash drafting: a
block of queries sees the context and the whole block), GQA and odd sizes. The reference runs
in fp32 and rounds the result to fp16: 2 fp16 ulps of the largest output are allowed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sm70_backend.kernels import attention, nvrtc, reference
from tests.sm70_backend.attention_cases import make_batch, new_kv, rel_error

FP16_TOL = 2 * 2.0**-10


def sdpa_rows(batch, r: int, causal: bool, window_left: int, window_right: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """SDPA (fp64) of request r's query rows over its dense K/V: [q_len, Hq, D]."""
    lo, hi = int(batch.query_start_loc[r]), int(batch.query_start_loc[r + 1])
    seq_len = int(batch.seq_lens[r])
    q = batch.q[lo:hi].double().transpose(0, 1)  # [Hq, L, D]
    k = batch.k[r].double().transpose(0, 1)  # [Hkv, S, D]
    v = batch.v[r].double().transpose(0, 1)
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    pos = torch.arange(seq_len - (hi - lo), seq_len).unsqueeze(1)
    key = torch.arange(seq_len).unsqueeze(0)
    mask = torch.ones(hi - lo, seq_len, dtype=torch.bool)
    if causal:
        mask &= key <= pos
    if window_left >= 0:
        mask &= key >= pos - window_left
    if window_right >= 0:
        mask &= key <= pos + window_right
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale)
    return out.transpose(0, 1)


CASES = {
    # name: q_lens, context_lens, Hq, Hkv, D, block_size, causal, window (left, right)
    "prefill": ([37, 64, 1], [0, 0, 0], 4, 4, 64, 16, True, (-1, -1)),
    "chunked_prefill": ([29, 16], [83, 130], 8, 2, 128, 16, True, (-1, -1)),
    "decode_gqa6": ([1, 1, 1, 1], [0, 17, 250, 511], 12, 2, 128, 32, True, (-1, -1)),
    "sliding_window": ([40, 1, 23], [100, 300, 0], 4, 1, 80, 16, True, (31, -1)),
    "non_causal_block": ([8, 8, 16], [45, 0, 200], 6, 2, 96, 16, False, (-1, -1)),
    "non_causal_window": ([8, 8], [3000, 10], 4, 2, 64, 64, False, (2047, -1)),
    "head256_mha": ([5, 33], [60, 7], 2, 2, 256, 16, True, (-1, -1)),
}


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_sdpa(case: str, layout: str) -> None:
    q_lens, ctx_lens, hq, hkv, d, bs, causal, (wl, wr) = CASES[case]
    seed = sum(map(ord, case)) + (layout == "HND")
    batch = make_batch(q_lens, ctx_lens, hq, hkv, d, bs, layout=layout, seed=seed)
    k_new, v_new = new_kv(batch)
    attention.write_kv(k_new, v_new, batch.kv_cache, batch.slot_mapping)  # CPU: the reference
    out = torch.full_like(batch.q, float("nan"))  # poisoned
    attention.paged_attention(
        batch.q, batch.kv_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, batch.scale,
        causal=causal, window_left=wl, window_right=wr, out=out,
    )  # fmt: skip
    for r in range(len(q_lens)):
        lo, hi = int(batch.query_start_loc[r]), int(batch.query_start_loc[r + 1])
        want = sdpa_rows(batch, r, causal, wl, wr)
        assert rel_error(out[lo:hi], want) <= FP16_TOL, (case, r)


def test_reference_ignores_padding_slots_and_rows_without_keys() -> None:
    batch = make_batch([3], [5], 2, 1, 64, 16, seed=3)
    cache = torch.zeros_like(batch.kv_cache)
    k, v = new_kv(batch)
    slots = batch.slot_mapping.clone()
    slots[1] = -1  # a padding token: nothing written
    reference.write_kv_reference(k, v, cache, slots)
    block, offset = int(slots[0]) // 16, int(slots[0]) % 16
    assert torch.equal(cache[block, :, offset, :64], k[0])
    assert torch.equal(cache[block, :, offset, 64:], v[0])
    assert int((cache != 0).any(-1).sum()) == 2 * 1  # two tokens x one KV head written
    # A window that excludes every key (right edge before the left): zeros, not NaN.
    mask = reference.visible_keys(3, 8, causal=False, window_left=0, window_right=-1)
    assert mask.sum(1).tolist() == [3, 2, 1]  # positions 5, 6, 7 see the keys from themselves on
    out = reference.paged_attention_reference(
        batch.q, batch.kv_cache.nan_to_num(0.0), batch.block_table, batch.query_start_loc, batch.seq_lens, 1.0,
        causal=True, window_left=0, window_right=-2,
    )  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out))


def test_kernel_modules_import_without_vllm() -> None:
    code = (
        "import sys, sm70_backend.kernels.attention, sm70_backend.kernels.nvrtc, sm70_backend.kernels.codecheck;"
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_startup_check_names_the_supported_sets() -> None:
    attention.check_supported(128, torch.float16, 16, 32, 8)
    with pytest.raises(ValueError, match=r"head size 72 .*supported: \(64, 80, 96, 112, 128, 256\)"):
        attention.check_supported(72, torch.float16, 16, 8, 8)
    with pytest.raises(ValueError, match=r"dtype torch.bfloat16 .*supported: torch.float16"):
        attention.check_supported(128, torch.bfloat16, 16, 8, 8)
    with pytest.raises(ValueError, match=r"block size 24 .*multiples of 16"):
        attention.check_supported(128, torch.float16, 24, 8, 8)
    with pytest.raises(ValueError, match=r"12 query heads over 8 KV heads"):
        attention.check_supported(128, torch.float16, 16, 12, 8)
    with pytest.raises(ValueError, match=r"at most 64 per KV head"):
        attention.check_supported(128, torch.float16, 16, 128, 1)


def test_split_policy_is_a_function_of_the_batch_shape() -> None:
    # 80 SMs (V100): a decode batch of 1 request and 8 KV heads gets splits; a long prefill none.
    assert attention.choose_splits(1, 1, 32, 8, 80) == 16
    assert attention.choose_splits(4, 4, 32, 8, 80) == 5
    assert attention.choose_splits(4096, 2, 32, 8, 80) == 1
    assert attention.tokens_per_tile(32, 8) == 16 and attention.tokens_per_tile(12, 1) == 5


def test_readme_names_every_kernel_with_its_sm70_status() -> None:
    """The README's table lists every CUDA kernel of this plugin and every Triton kernel of
    qwen38_plugin's GPU path (compiled for sm_70 by qsa_paged_compile_check.py)."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "src" / "sm70_backend" / "README.md").read_text()
    cuda = re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)', nvrtc.kernel_source())
    triton = re.findall(
        r"@triton\.jit\s+def (\w+)", (root / "src/qwen38_plugin/qwen38_plugin/ops/qsa_paged.py").read_text()
    )
    kernels = set(cuda) | {name for name in triton if name.endswith("_kernel")}
    assert {"sm70_flash_attention", "sm70_write_kv", "sm70_merge_splits", "_sparse_attention_kernel"} <= kernels
    missing = sorted(name for name in kernels if f"`{name}`" not in readme)
    assert not missing, f"kernels without a row in src/sm70_backend/README.md: {missing}"
