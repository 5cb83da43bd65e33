"""FLASH_ATTN_V100's CUDA kernels against the plain-torch reference, on a CUDA device.

Skipped without CUDA (saying why). On the H200 the kernels are compiled for sm_90 by the
NVRTC that torch brings (the m8n8k4 instruction is emulated there, see test_kernel_compile.py);
on a V100 for sm_70. Each case draws fresh random inputs, poisons the output with NaN and checks
that every row of a real token is written, padding rows are not, and the result is within 4 fp16
ulps of the largest output of the fp32 reference (the kernel rounds the probabilities to fp16 for
P V, as flash attention does). The cache write kernel must match the reference bit for bit.
One command on a GPU machine (no vLLM needed):

    PYTHONPATH=src/sm70_backend:. python -m pytest --noconftest -q -rA tests/sm70_backend/test_attention_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from sm70_backend.kernels import attention
from tests.sm70_backend.attention_cases import make_batch, new_kv, rel_error

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the NVRTC-compiled kernels); none here"
)
TOL = 4 * 2.0**-10

CASES = {
    # name: q_lens, context_lens, Hq, Hkv, D, block_size, causal, (window_left, window_right)
    "prefill_d64": ([37, 64, 1, 130], [0, 0, 0, 0], 4, 4, 64, 16, True, (-1, -1)),
    "chunked_prefill_gqa4": ([29, 16, 77], [83, 130, 1], 8, 2, 128, 16, True, (-1, -1)),
    "decode_gqa6": ([1] * 7, [0, 17, 250, 511, 1023, 2, 4000], 12, 2, 128, 32, True, (-1, -1)),
    "decode_gqa12_d256": ([1, 1, 1], [700, 33, 5000], 24, 2, 256, 64, True, (-1, -1)),
    "sliding_window_d80": ([40, 1, 23], [100, 300, 0], 4, 1, 80, 16, True, (31, -1)),
    "sliding_window_decode": ([1, 1], [5000, 20], 16, 8, 128, 16, True, (1023, -1)),
    "non_causal_block_d96": ([8, 8, 16], [45, 0, 200], 6, 2, 96, 16, False, (-1, -1)),
    "non_causal_window_d112": ([8, 8], [3000, 10], 4, 2, 112, 64, False, (2047, -1)),
    "verify_gqa8": ([8, 8, 8, 8], [100, 2000, 31, 64], 32, 4, 128, 16, True, (-1, -1)),
}


def run_case(case: str, layout: str, num_splits: int, seed: int) -> None:
    q_lens, ctx_lens, hq, hkv, d, bs, causal, (wl, wr) = CASES[case]
    batch = make_batch(q_lens, ctx_lens, hq, hkv, d, bs, layout=layout, seed=seed).to("cuda")
    k_new, v_new = new_kv(batch)
    expected_cache = batch.kv_cache.cpu()  # the reference writes a CPU copy
    attention.write_kv(k_new.cpu(), v_new.cpu(), expected_cache, batch.slot_mapping.cpu())
    attention.write_kv(k_new, v_new, batch.kv_cache, batch.slot_mapping)
    torch.cuda.synchronize()
    assert torch.equal(batch.kv_cache.cpu().nan_to_num(7.0), expected_cache.nan_to_num(7.0))
    pad = 5  # tokens past query_start_loc[-1] (CUDA-graph padding): must stay untouched
    q = torch.cat([batch.q, torch.randn(pad, hq, d, device="cuda", dtype=batch.q.dtype)])
    out = torch.full_like(q, float("nan"))
    attention.paged_attention(
        q, batch.kv_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, batch.scale,
        causal=causal, window_left=wl, window_right=wr, out=out, num_splits=num_splits,
    )  # fmt: skip
    torch.cuda.synchronize()
    want = attention.paged_attention(
        batch.q.cpu(), batch.kv_cache.cpu(), batch.block_table.cpu(), batch.query_start_loc.cpu(),
        batch.seq_lens.cpu(), batch.scale, causal=causal, window_left=wl, window_right=wr,
    )  # fmt: skip
    tokens = batch.q.shape[0]
    assert not out[:tokens].isnan().any(), "rows of real tokens not written"
    assert out[tokens:].isnan().all(), "padding rows written"
    assert rel_error(out[:tokens].cpu(), want) <= TOL


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case: str, layout: str) -> None:
    run_case(case, layout, num_splits=1, seed=sum(map(ord, case + layout)))


@pytest.mark.parametrize("num_splits", [2, 3, 16])
@pytest.mark.parametrize("case", ["decode_gqa6", "decode_gqa12_d256", "sliding_window_decode", "verify_gqa8"])
def test_split_kv_matches_reference(case: str, num_splits: int) -> None:
    run_case(case, "NHD", num_splits=num_splits, seed=num_splits)


def test_decode_in_a_cuda_graph_equals_eager() -> None:
    batch = make_batch([1] * 6, [10, 300, 1000, 4, 64, 2048], 16, 4, 128, 16, seed=5).to("cuda")
    k_new, v_new = new_kv(batch)
    attention.write_kv(k_new, v_new, batch.kv_cache, batch.slot_mapping)
    splits = attention.choose_splits(6, 6, 16, 4, torch.cuda.get_device_properties(0).multi_processor_count)
    partials = attention.workspace(6, 16, 128, splits, torch.device("cuda"))
    out = torch.full_like(batch.q, float("nan"))

    def step() -> None:
        attention.paged_attention(
            batch.q, batch.kv_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, batch.scale,
            out=out, num_splits=splits, partials=partials,
        )  # fmt: skip

    step()  # compile and load outside the capture
    torch.cuda.synchronize()
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # New values in the same buffers: the replay follows them.
    batch.q.copy_(torch.randn_like(batch.q))
    graph.replay()
    step_out = out.clone()
    step()
    torch.cuda.synchronize()
    assert torch.equal(step_out, out)
