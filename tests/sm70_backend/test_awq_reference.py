"""The AWQ W4A16 plain-torch reference (`kernels.awq_reference`) against independent constructions.

- Packing: words built nibble by nibble in Python from vLLM's own statement of AWQ's order
  (`auto_awq._REVERSE_AWQ_PACK_ORDER`, the inverse permutation), not from our `pack_awq`.
- Dequantization: ``(q - z) * s`` element by element in fp16 against `dequantize`, bit for bit.
- Quantization round trip: random fp16 weights quantized AWQ-style come back within half a scale.
- Matmul: against a float64 matmul of the dequantized weights, within fp32 summation error.
- MoE: against a per-token loop over dense dequantized experts; the expert-sorted blocks of
  `align_block_size` against their definition.
"""

from __future__ import annotations

import pytest
import torch

from sm70_backend.kernels import awq_reference as ref


def awq_order_from_vllm() -> list[int]:
    from vllm.model_executor.layers.quantization.auto_awq import _REVERSE_AWQ_PACK_ORDER

    # vLLM: column c is nibble _REVERSE_AWQ_PACK_ORDER[c]; we want nibble i -> column.
    order = [0] * 8
    for column, nibble in enumerate(_REVERSE_AWQ_PACK_ORDER):
        order[nibble] = column
    return order


def pack_by_hand(values: list[list[int]]) -> torch.Tensor:
    order = awq_order_from_vllm()
    rows = []
    for row in values:
        words = []
        for j in range(len(row) // 8):
            word = 0
            for nibble in range(8):
                word |= row[8 * j + order[nibble]] << (4 * nibble)
            words.append(word - (1 << 32) if word >= 1 << 31 else word)
        rows.append(words)
    return torch.tensor(rows, dtype=torch.int32)


def test_awq_order_is_vllms() -> None:
    assert list(ref.AWQ_ORDER) == awq_order_from_vllm() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_unpack_and_pack_against_words_built_by_hand() -> None:
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (5, 24), generator=g)
    packed = pack_by_hand(values.tolist())
    assert torch.equal(ref.unpack_awq(packed), values.to(torch.int32))
    assert torch.equal(ref.pack_awq(values), packed)
    # Nibble 7 set (negative int32 words) survives.
    top = torch.full((1, 8), 15)
    assert ref.pack_awq(top).item() == -1 and torch.equal(ref.unpack_awq(ref.pack_awq(top)), top.to(torch.int32))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_is_q_minus_z_times_s_in_fp16(group_size: int) -> None:
    g = torch.Generator().manual_seed(group_size)
    k, n = 2 * group_size, 40
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(0, 16, (k // group_size, n), generator=g)
    s = (torch.rand(k // group_size, n, generator=g) * 0.02 + 1e-3).to(torch.float16)
    w = ref.dequantize(pack_by_hand(q.tolist()), pack_by_hand(z.tolist()), s)
    assert w.dtype == torch.float16 and w.shape == (k, n)
    for kk in (0, group_size - 1, group_size, k - 1):
        for nn in (0, 7, 8, n - 1):
            gi = kk // group_size
            want = torch.tensor(float(q[kk, nn] - z[gi, nn]), dtype=torch.float16) * s[gi, nn]
            assert w[kk, nn].item() == want.item()
    # Whole tensor, one rounding of an exact product: equals fp64 (q - z) * s rounded to fp16.
    exact = (q - z.repeat_interleave(group_size, 0)).double() * s.double().repeat_interleave(group_size, 0)
    assert torch.equal(w, exact.to(torch.float16))


@pytest.mark.parametrize(("k", "n", "group_size"), [(128, 64, 32), (256, 136, 64), (384, 8, 128)])
def test_quantize_round_trip_and_matmul(k: int, n: int, group_size: int) -> None:
    g = torch.Generator().manual_seed(k + n)
    w = (torch.randn(k, n, generator=g) * 0.05).to(torch.float16)
    qweight, qzeros, scales = ref.quantize_awq(w, group_size)
    assert qweight.shape == (k, n // 8) and qzeros.shape == (k // group_size, n // 8)
    assert scales.shape == (k // group_size, n) and scales.dtype == torch.float16
    deq = ref.dequantize(qweight, qzeros, scales)
    bound = scales.float().repeat_interleave(group_size, 0) * 0.5 + 1e-3 * w.float().abs() + 1e-6
    assert ((deq.float() - w.float()).abs() <= bound).all()
    x = torch.randn(7, k, generator=g).to(torch.float16)
    y = ref.awq_matmul(x, qweight, qzeros, scales)
    want = (x.double() @ deq.double()).to(torch.float16)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, want, rtol=2e-3, atol=2e-3)


def make_experts(num_experts: int, k: int, n: int, group_size: int, g: torch.Generator):  # type: ignore[no-untyped-def]
    packed = [ref.quantize_awq((torch.randn(k, n, generator=g) * 0.05).half(), group_size) for _ in range(num_experts)]
    return tuple(torch.stack([p[i] for p in packed]) for i in range(3))


def test_moe_reference_against_a_token_loop() -> None:
    g = torch.Generator().manual_seed(3)
    num_experts, hidden, inter, group_size, top_k, tokens = 5, 64, 96, 32, 2, 9
    w13 = make_experts(num_experts, hidden, 2 * inter, group_size, g)
    w2 = make_experts(num_experts, inter, hidden, group_size, g)
    x = torch.randn(tokens, hidden, generator=g).half()
    topk_ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, top_k, generator=g)
    out = ref.moe_reference(x, w13, w2, topk_weights, topk_ids)
    dense13 = [ref.dequantize(w13[0][e], w13[1][e], w13[2][e]).double() for e in range(num_experts)]
    dense2 = [ref.dequantize(w2[0][e], w2[1][e], w2[2][e]).double() for e in range(num_experts)]
    for t in range(tokens):
        total = torch.zeros(hidden, dtype=torch.float64)
        for s in range(top_k):
            e = int(topk_ids[t, s])
            h = x[t].double() @ dense13[e]
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            total += float(topk_weights[t, s]) * (a @ dense2[e])
        torch.testing.assert_close(out[t].double(), total, rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize(("tokens", "top_k", "num_experts", "block_m"), [(1, 1, 4, 64), (9, 2, 5, 4), (40, 8, 16, 16)])
def test_align_block_size_sorts_rows_into_expert_blocks(
    tokens: int, top_k: int, num_experts: int, block_m: int
) -> None:
    g = torch.Generator().manual_seed(tokens)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    sorted_ids, expert_ids, total = ref.align_block_size(topk_ids, num_experts, block_m)
    numel = tokens * top_k
    assert sorted_ids.numel() % block_m == 0 and sorted_ids.numel() >= numel + num_experts * (block_m - 1)
    assert expert_ids.numel() == sorted_ids.numel() // block_m
    flat = topk_ids.reshape(-1)
    real = sorted_ids[sorted_ids < numel]
    assert sorted(real.tolist()) == list(range(numel))  # every (token, slot) once
    used = int(total.item()) // block_m
    for b in range(expert_ids.numel()):
        block = sorted_ids[b * block_m : (b + 1) * block_m]
        rows = block[block < numel]
        if b >= used:
            assert expert_ids[b] == -1 and rows.numel() == 0
            continue
        assert (flat[rows.long()] == expert_ids[b]).all()
        # Real rows first, padding after them (the kernel relies on it).
        assert (block[: rows.numel()] < numel).all()
    # An id of another rank (outside 0 .. E - 1) is dropped.
    topk_ids[0, 0] = -1
    sorted_ids, _, _ = ref.align_block_size(topk_ids, num_experts, block_m)
    assert 0 not in sorted_ids.tolist() and sorted_ids.lt(numel).sum() == numel - 1


def test_linear_op_is_one_opaque_call_under_torch_compile() -> None:
    # vLLM compiles the model on CUDA by default; the launch code (raw pointers, alignment checks)
    # cannot be traced, so the layer calls a torch custom op. A full-graph compile of a function
    # around it must succeed (Dynamo refuses a graph break here) and give the eager result, for
    # two batch sizes through one dynamic graph.
    from sm70_backend.kernels import awq

    g = torch.Generator().manual_seed(3)
    qweight, qzeros, scales = ref.quantize_awq((torch.randn(128, 64, generator=g) * 0.05).half(), 32)

    def layer(x: torch.Tensor) -> torch.Tensor:
        return awq.awq_linear_op(x * 2, qweight, qzeros, scales) + 1

    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: object) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=record)
    for rows in (3, 9):
        x = torch.randn(rows, 128, generator=g).half()
        out = compiled(x)
        assert out.shape == (rows, 64)
        assert torch.equal(out, layer(x))
        assert torch.equal(out, ref.awq_matmul(x * 2, qweight, qzeros, scales) + 1)
    # one graph for both sizes, holding the op as one node (the unpacking inside it is not traced)
    assert len(graphs) == 1
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.sm70_backend.awq_linear.default) == 1, targets
    assert not any("rshift" in str(t) or "bitwise" in str(t) for t in targets), targets
