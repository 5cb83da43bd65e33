"""The AWQ W4A16 CUDA kernels (`awq_w4a16.cu`) against the plain-torch reference, on a CUDA device.

Skipped without CUDA (saying why). On the H200 the kernels are compiled for sm_90 by the NVRTC that
torch brings (m8n8k4 emulated there, see test_awq_compile.py); on a V100 for sm_70. Each case draws
fresh random weights (quantized AWQ-style) and inputs, poisons the output with NaN and checks that
every element is written and within 2 fp16 ulps of the largest output of the reference (both
dequantize to the same fp16 weights and accumulate in fp32; only the order of the sums and the
final rounding differ). Odd sizes: M not a multiple of the tiles, N a multiple of 8 but not of 64,
a strided x, K split over the grid (decode), MoE blocks with padding, a decode step replayed from a
CUDA graph. One command on a GPU machine (no vLLM needed):

    PYTHONPATH=src/sm70_backend:. python -m pytest --noconftest -q -rA tests/sm70_backend/test_awq_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from sm70_backend.kernels import awq
from sm70_backend.kernels import awq_reference as ref

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the NVRTC-compiled AWQ kernels); none here"
)
ULPS = 2 * 2.0**-10


def weights(k: int, n: int, group_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ref.quantize_awq((torch.randn(k, n, generator=g) * 0.05).half(), group_size)


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.cpu()
    assert not got.isnan().any(), "output elements not written"
    err = (got.float() - want.float()).abs().max().item()
    assert err <= ULPS * want.float().abs().max().item() + 1e-6, err


DENSE = {
    # name: M, K, N, group size, force the tensor-core kernel
    "decode_1": (1, 4096, 4096, 128, False),
    "decode_3_odd_n": (3, 1024, 200, 32, False),
    "decode_8_g64": (8, 2048, 1032, 64, False),
    "decode_split_many": (2, 8192, 64, 128, False),
    "small_m_on_tensor_cores": (5, 512, 136, 64, True),
    "prefill_9": (9, 256, 512, 32, False),
    "prefill_77_odd_n": (77, 1024, 520, 128, False),
    "prefill_130": (130, 2048, 1024, 64, False),
    "prefill_513": (513, 4096, 1536, 128, False),
}


@pytest.mark.parametrize("case", list(DENSE))
def test_linear_matches_reference(case: str) -> None:
    m, k, n, group_size, force_gemm = DENSE[case]
    qweight, qzeros, scales = weights(k, n, group_size, seed=sum(map(ord, case)))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half()
    want = ref.awq_matmul(x, qweight, qzeros, scales)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    awq.awq_linear(x.cuda(), qweight.cuda(), qzeros.cuda(), scales.cuda(), out=out, force_gemm=force_gemm)
    torch.cuda.synchronize()
    assert_close_to_reference(out, want)


@pytest.mark.parametrize("m", [4, 70])
def test_strided_input_rows(m: int) -> None:
    qweight, qzeros, scales = weights(512, 264, 64, seed=m)
    wide = torch.randn(m, 512 + 64).half()
    x = wide[:, 32 : 32 + 512]  # row stride 576, 16-byte aligned rows
    want = ref.awq_matmul(x, qweight, qzeros, scales)
    got = awq.awq_linear(wide.cuda()[:, 32 : 32 + 512], qweight.cuda(), qzeros.cuda(), scales.cuda())
    torch.cuda.synchronize()
    assert_close_to_reference(got, want)


def test_misaligned_input_is_refused_not_misread() -> None:
    qweight, qzeros, scales = weights(256, 64, 32, seed=0)
    x = torch.randn(4, 260, dtype=torch.float16, device="cuda")[:, 2:258]
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        awq.awq_linear(x, qweight.cuda(), qzeros.cuda(), scales.cuda())


MOE = {
    # name: tokens, experts, top_k, hidden, intermediate, group size
    "decode_1_token": (1, 8, 2, 256, 128, 32),
    "decode_7_tokens": (7, 16, 4, 512, 256, 128),
    "prefill_100": (100, 8, 2, 256, 192, 64),
    "prefill_300_top8": (300, 32, 8, 512, 128, 128),
}


def experts(e: int, k: int, n: int, group_size: int, seed: int) -> awq.AwqExperts:
    packed = [weights(k, n, group_size, seed * 100 + i) for i in range(e)]
    return awq.AwqExperts(*(torch.stack([p[i] for p in packed]) for i in range(3)))


@pytest.mark.parametrize("case", list(MOE))
def test_moe_matches_reference(case: str) -> None:
    tokens, e, top_k, hidden, inter, group_size = MOE[case]
    seed = sum(map(ord, case))
    w13, w2 = experts(e, hidden, 2 * inter, group_size, seed), experts(e, inter, hidden, group_size, seed + 1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).half()
    topk_ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, top_k, generator=g)
    want = ref.moe_reference(x, w13.as_tuple(), w2.as_tuple(), topk_weights, topk_ids)
    on_gpu = [awq.AwqExperts(*(t.cuda() for t in w.as_tuple())) for w in (w13, w2)]
    got = awq.awq_moe(x.cuda(), on_gpu[0], on_gpu[1], topk_weights.cuda(), topk_ids.cuda())
    torch.cuda.synchronize()
    # The intermediate is rounded to fp16 on both sides, so an element may differ by an fp16 ulp of
    # the intermediate before the down projection: allow 4 ulps of the largest output.
    err = (got.cpu().float() - want.float()).abs().max().item()
    assert not got.isnan().any() and err <= 2 * ULPS * want.float().abs().max().item(), err


def test_moe_drops_experts_of_other_ranks() -> None:
    w13, w2 = experts(4, 128, 128, 32, 1), experts(4, 64, 128, 32, 2)
    x = torch.randn(3, 128).half()
    ids = torch.tensor([[0, -1], [-1, 3], [2, 1]])
    weights_ = torch.rand(3, 2)
    want = ref.moe_reference(x, w13.as_tuple(), w2.as_tuple(), weights_, ids)
    on_gpu = [awq.AwqExperts(*(t.cuda() for t in w.as_tuple())) for w in (w13, w2)]
    got = awq.awq_moe(x.cuda(), on_gpu[0], on_gpu[1], weights_.cuda(), ids.cuda())
    torch.cuda.synchronize()
    assert_close_to_reference(got, want)


def test_decode_step_in_a_cuda_graph_equals_eager() -> None:
    qweight, qzeros, scales = (t.cuda() for t in weights(4096, 1024, 128, seed=9))
    x = torch.randn(4, 4096, device="cuda", dtype=torch.float16)
    out = torch.full((4, 1024), float("nan"), dtype=torch.float16, device="cuda")
    awq.awq_linear(x, qweight, qzeros, scales, out=out)  # compile and load outside the capture
    torch.cuda.synchronize()
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        awq.awq_linear(x, qweight, qzeros, scales, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x.copy_(torch.randn_like(x))
    graph.replay()
    replayed = out.clone()
    awq.awq_linear(x, qweight, qzeros, scales, out=out)
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)


def test_moe_decode_in_a_cuda_graph_equals_eager() -> None:
    """Sorting into expert blocks has no host sync and no data-dependent shape, so vLLM can capture it."""
    w13, w2 = experts(16, 256, 256, 64, 3), experts(16, 128, 256, 64, 4)
    w13, w2 = (awq.AwqExperts(*(t.cuda() for t in w.as_tuple())) for w in (w13, w2))
    x = torch.randn(4, 256, device="cuda", dtype=torch.float16)
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(4)]).cuda()
    weights_ = torch.rand(4, 4, device="cuda")
    out = torch.empty(4, 256, device="cuda", dtype=torch.float16)

    def step() -> None:
        out.copy_(awq.awq_moe(x, w13, w2, weights_, ids))

    step()
    torch.cuda.synchronize()
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ids.copy_(torch.stack([torch.randperm(16)[:4] for _ in range(4)]))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    step()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out) and not torch.equal(replayed, eager)
