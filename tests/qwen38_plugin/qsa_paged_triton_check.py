"""`ops.qsa_paged`'s Triton kernels against its torch references, on fresh random inputs per case.

Runs under ``TRITON_INTERPRET=1`` on CPU (test_qwen38_qsa_paged.py starts it in a subprocess:
the interpreter is chosen when a kernel is decorated) and natively on CUDA. Outputs are
poisoned (NaN) before each run; caches are NaN-poisoned with a dim 0 strided past one page.
Prints one ``PASS name ...`` / ``FAIL name ...`` line per check; exits non-zero on a failure.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
from triton_check_runner import run_checks  # this script's folder is first on sys.path

from qwen38_plugin.ops import qsa_paged, qsa_step_metadata

# Under the interpreter the kernels run on CPU tensors; natively, on CUDA. The interpreter rounds
# fp32 to bf16 by truncation (CUDA and torch round to nearest even) and its bf16 tl.dot is wrong, so
# the bf16 cases of the kernels that round or multiply in bf16 run natively only.
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"
NATIVE = DEVICE == "cuda"
GEN = torch.Generator().manual_seed(1234)


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN).to(dtype).to(DEVICE)


def strided_cache(pages: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    storage = torch.full((pages, 2, *shape), float("nan"), dtype=dtype, device=DEVICE)
    return storage[:, 0], storage


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.float(), expected.float()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def check_write_kv() -> str:
    cases = 0
    for tokens, heads, dim, block_size, dtype in [
        (7, 2, 16, 4, torch.float32),
        (5, 1, 24, 8, torch.float16),
        (9, 3, 8, 2, torch.float32),
    ]:
        cache, storage = strided_cache(12, (heads, block_size, 2 * dim), dtype)
        slots = (block_size + torch.randperm(11 * block_size, generator=GEN)[:tokens]).to(DEVICE)  # never block 0
        slots[::3] = -1
        k = randn(tokens, heads, 2 * dim)[..., ::2]  # strided inputs (a view of a wider projection)
        v = randn(tokens, heads, dim, dtype=dtype)
        expected = storage.clone()
        qsa_paged.write_kv_torch(expected[:, 0], slots, k, v)
        qsa_paged.write_kv(cache, slots, k, v, backend="triton")
        assert same(storage, expected), f"write_kv {tokens}x{heads}x{dim} {dtype}"
        cases += 1
    return f"{cases} cases"


def check_write_rows() -> str:
    cases = 0
    shapes = [
        (6, 4, 16, torch.float32),
        (5, 3, 12, torch.bfloat16),
        (1, 8, 8, torch.float16),
        (4, 2, 16, torch.float16),
    ]
    for tokens, rows, features, dtype in shapes:
        cache, storage = strided_cache(5, (1, rows, features), dtype)
        slots = (rows + torch.randperm(4 * rows, generator=GEN)[:tokens]).to(DEVICE)
        if tokens > 2:
            slots[1] = -1
        # fp32 values into an fp16 cache: cast on the way (not into bf16: the interpreter truncates
        # fp32 to bf16, where CUDA rounds to nearest even as torch does)
        values = randn(tokens, features, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
        expected = storage.clone()
        qsa_paged.write_rows_torch(expected[:, 0], slots, values)
        qsa_paged.write_rows(cache, slots, values, backend="triton")
        assert same(storage, expected), f"write_rows {tokens}x{features} {dtype}"
        cases += 1
    return f"{cases} cases"


def key_cache_case(
    requests: int, groups: int, rows_per_block: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-poisoned, strided key cache with ``groups`` random keys per request, shuffled blocks."""
    per_request = -(-groups // rows_per_block)
    cache, _ = strided_cache(1 + requests * per_request, (1, rows_per_block, dim), dtype)
    table = (1 + torch.randperm(requests * per_request, generator=GEN)).view(requests, per_request).to(DEVICE)
    g = torch.arange(groups, device=DEVICE)
    for r in range(requests):
        cache[table[r, g // rows_per_block], 0, g % rows_per_block] = randn(groups, dim, dtype=dtype)
    return cache, table.int()


def check_index_scores() -> str:
    # both forms of the kernel: fp32 FMA (sm_70, fp32 keys) and tensor cores on split queries (sm_80+)
    cases = 0
    for heads, dim, rows_per_block, max_groups, topk, dtype, parts in [
        (4, 16, 4, 37, 3, torch.float32, 0),
        (3, 24, 2, 20, 2, torch.float16, 0),
        (16, 32, 8, 70, 5, torch.bfloat16, 0),
        (4, 16, 4, 37, 3, torch.float16, 2),
        *([(16, 32, 8, 70, 5, torch.bfloat16, 3)] if NATIVE else []),
    ]:
        cache, table = key_cache_case(3, max_groups, rows_per_block, dim, dtype)
        tokens = 8
        q = randn(tokens, heads, dim)
        token_req = torch.tensor([0, 0, 1, 2, 2, 2, -1, 1], dtype=torch.int32, device=DEVICE)
        complete = torch.randint(0, max_groups + 1, (tokens,), generator=GEN).to(DEVICE)
        complete[1] = topk  # at the budget: no scores
        complete[6] = 0
        out = torch.full((tokens, max_groups), float("nan"), device=DEVICE)
        want = torch.empty_like(out)
        qsa_paged.index_scores_triton(q, cache, table, token_req, complete, topk=topk, out=out, split_parts=parts)
        qsa_paged.index_scores_torch(q, cache, table, token_req, complete, topk=topk, out=want)
        assert not out.isnan().any(), "index scores: unwritten elements"
        assert torch.equal(out.isinf(), want.isinf()), "index scores: -inf in other places"
        finite = want.isfinite()
        err = rel(out[finite], want[finite]) if finite.any() else 0.0
        assert err < 1e-5, f"index scores rel err {err:.3g} ({dtype}, split parts {parts})"
        cases += 1
    return f"{cases} cases"


def check_select_groups() -> str:
    # random rows, rows of many exact ties (quantised scores, zeros), rows at or under the budget,
    # rows wider than one register block (several chunks)
    cases = 0
    # (rows, groups, topk, block): rows of at most `block` scores held in registers (the kernel
    # bisects for the threshold), longer ones in chunks (torch.topk gives the threshold)
    for rows, groups, topk, block in [
        (6, 40, 5, None),
        (5, 300, 17, 128),
        *([(3, 9000, 40, None)] if NATIVE else [(3, 3000, 40, 1024)]),
    ]:
        scores = randn(rows, groups)
        scores[1] = (scores[1] * 2).round().clamp(min=0)  # a handful of values, many zeros
        scores[2] = 0.0
        scores[2, 7] = -0.0 if groups > 7 else 0.0  # -0.0 ties with +0.0
        complete = torch.randint(topk + 1, groups + 1, (rows,), generator=GEN).to(DEVICE)
        complete[0] = topk  # at the budget
        if rows > 4:
            complete[4] = 1
        for r in range(rows):
            scores[r, int(complete[r]) :] = float("-inf")
        want = qsa_paged.select_groups_lowest_torch(scores, complete, topk)
        out = torch.full((rows, topk), -7, dtype=torch.int32, device=DEVICE)
        qsa_paged.select_groups_triton(scores, complete, topk, out, block=block)
        assert torch.equal(out.long(), want), f"select groups {rows}x{groups} top {topk}:\n{out}\n{want}"
        # the rule itself, for the all-ties row: the lowest groups
        assert out[2].tolist() == list(range(topk)), out[2]
        cases += 1
    return f"{cases} cases"


def check_group_keys() -> str:
    cases, worst = 0, 0.0
    shapes = [(4, 8, 16, 8, torch.float32), (3, 6, 12, 12, torch.float16), (1, 2, 8, 4, torch.float32)]
    if NATIVE:
        shapes.append((4, 4, 32, 16, torch.bfloat16))
    for ratio, capacity, dim, rotary, dtype in shapes:
        # three requests continuing earlier steps: starts inside a group, at a boundary, at 0
        starts, counts = [ratio + 1, 2 * ratio, 0], [2 * ratio + 1, ratio, ratio + 2]
        token_req = torch.tensor([r for r, n in enumerate(counts) for _ in range(n)] + [-1], dtype=torch.int32)
        positions = torch.tensor([s + i for s, n in zip(starts, counts, strict=True) for i in range(n)] + [0])
        ring, _ = strided_cache(5, (1, capacity, dim), dtype)
        # a column of a [R, 2] table, as a ring's block table column is: strided
        ring_block = torch.tensor([[3, 0], [1, 0], [4, 0]], dtype=torch.int32, device=DEVICE)[:, 0]
        for r, start in enumerate(starts):  # the ring rows of each request's last positions before the step
            for p in range(max(0, start - capacity), start):
                ring[ring_block[r], 0, p % capacity] = randn(dim, dtype=dtype)
        raw = randn(len(positions), dim, dtype=dtype)
        kwargs = {"ratio": ratio, "k_norm_weight": randn(dim, dtype=dtype) * 0.2, "eps": 1e-6, "rope_theta": 1e4,
                  "rotary_dim": rotary}  # fmt: skip
        args = (raw, ring, ring_block, token_req.to(DEVICE), positions.to(DEVICE),
                torch.tensor(starts, dtype=torch.int32, device=DEVICE))  # fmt: skip
        got = qsa_paged.group_keys_triton(*args, **kwargs)  # type: ignore[arg-type]
        want = qsa_paged.group_keys_torch(*args, **kwargs)  # type: ignore[arg-type]
        closing = ((positions + 1) % ratio == 0) & (token_req >= 0)
        assert bool(closing.any()) and torch.isfinite(got).all()
        err = rel(got[closing.to(DEVICE)], want[closing.to(DEVICE)])
        tol = {torch.float32: 1e-5, torch.float16: 2 * 2**-10, torch.bfloat16: 2 * 2**-7}[dtype]
        assert err < tol, f"group keys rel err {err:.3g} (ratio {ratio}, {dtype})"
        worst = max(worst, err)
        cases += 1
    return f"{cases} cases, worst rel err {worst:.2e}"


def check_index_topk() -> str:
    cases = 0
    for heads, dim, ratio, topk, max_groups in [(8, 16, 4, 3, 30), (8, 8, 1, 6, 40), (8, 12, 3, 2, 25)]:
        cache, table = key_cache_case(2, max_groups, 4, dim, torch.float32)
        positions = torch.randint(0, max_groups * ratio, (9,), generator=GEN).to(DEVICE)
        token_req = torch.tensor([0, 0, 0, 0, 1, 1, 1, -1, -1], dtype=torch.int32, device=DEVICE)
        q = randn(9, heads, dim)
        args = (q, cache, table, token_req, positions)
        got = qsa_paged.index_topk(*args, ratio=ratio, topk=topk, max_groups=max_groups, backend="triton")
        want = qsa_paged.index_topk(*args, ratio=ratio, topk=topk, max_groups=max_groups, backend="torch")
        assert torch.equal(got, want), f"index_topk ratio {ratio}:\n{got}\n{want}"
        cases += 1
    return f"{cases} cases"


ATTENTION_REQUESTS, ATTENTION_MAX_LEN = 3, 80


def attention_case(
    tokens: int,
    heads: int,
    kv_heads: int,
    dim: int,
    ratio: int,
    topk: int,
    block_size: int,
    dtype: torch.dtype,
    dense: bool,
) -> dict[str, object]:
    """Random paged K/V (every row of every request written), queries at random positions with a
    random valid selection (sorted groups, -1 past the complete ones), two padding tokens."""
    requests, max_len = ATTENTION_REQUESTS, ATTENTION_MAX_LEN
    per_request = -(-max_len // block_size)
    cache, _ = strided_cache(1 + requests * per_request, (kv_heads, block_size, 2 * dim), dtype)
    table = (1 + torch.randperm(requests * per_request, generator=GEN)).view(requests, per_request).to(DEVICE)
    pos = torch.arange(max_len, device=DEVICE)
    for r in range(requests):
        cache[table[r, pos // block_size], :, pos % block_size] = randn(max_len, kv_heads, 2 * dim, dtype=dtype)
    token_req = torch.tensor([*sorted(torch.randint(0, requests, (tokens - 2,), generator=GEN).tolist()), -1, -1])
    positions = torch.randint(0, max_len, (tokens,), generator=GEN)
    selected = torch.full((tokens, topk), -1, dtype=torch.int32)
    for t in range(tokens):
        complete = (int(positions[t]) + 1) // ratio
        if complete <= topk:
            selected[t, :complete] = torch.arange(complete, dtype=torch.int32)
        else:
            selected[t] = torch.randperm(complete, generator=GEN)[:topk].sort().values.int()
    return {
        "q": randn(tokens, heads, dim, dtype=dtype),
        "gate": randn(tokens, heads * dim, dtype=dtype),
        "kv_cache": cache,
        "kv_block_table": table.int(),
        "token_req": token_req.int().to(DEVICE),
        "positions": positions.to(DEVICE),
        "selected": None if dense else selected.to(DEVICE),
    }


def check_attention(splits: list[int], which: list[int] | None = None) -> str:
    cases, worst = 0, {torch.float32: 0.0, torch.float16: 0.0}
    shapes = [  # tokens, Hq, Hkv, D, ratio, topk, BS, dtype, dense
        (6, 4, 2, 16, 4, 3, 8, torch.float32, False),
        (5, 6, 2, 24, 3, 4, 6, torch.float32, False),  # head group of 3, D not a power of two
        (4, 2, 2, 16, 1, 5, 4, torch.float32, False),  # ratio 1, MHA
        (5, 16, 1, 16, 4, 2, 16, torch.float32, False),  # 16 query heads per KV head
        (4, 4, 2, 16, 4, 3, 8, torch.float32, True),  # dense (no indexer)
        (4, 4, 2, 32, 4, 3, 8, torch.float16, False),
    ]
    for index, (tokens, heads, kv_heads, dim, ratio, topk, block_size, dtype, dense) in enumerate(shapes):
        if which is not None and index not in which:
            continue
        for num_splits in splits:
            case = attention_case(tokens, heads, kv_heads, dim, ratio, topk, block_size, dtype, dense)
            kwargs = {"ratio": ratio, "scale": dim**-0.5}
            want = qsa_paged.sparse_attention_torch(*case.values(), **kwargs)  # type: ignore[arg-type]
            out = torch.full_like(want, float("nan"))
            qsa_paged.sparse_attention_triton(
                *case.values(),
                **kwargs,
                out=out,
                num_splits=num_splits,  # type: ignore[arg-type]
                block_n=16,
            )
            assert not out.isnan().any(), f"attention: unwritten or NaN outputs ({dtype}, splits {num_splits})"
            err = rel(out[:-2], want[:-2])  # padding rows: don't-care (finite, checked above)
            tol = 1e-5 if dtype == torch.float32 else 4 * 2**-10
            assert err < tol, (
                f"attention rel err {err:.3g} (Hq {heads} Hkv {kv_heads} D {dim} ratio {ratio} "
                f"{'dense' if dense else 'sparse'} {dtype} splits {num_splits})"
            )
            worst[dtype] = max(worst[dtype], err)
            cases += 1
    return f"{cases} cases, worst rel err fp32 {worst[torch.float32]:.2e}, fp16 {worst[torch.float16]:.2e}"


def dcp_shares(case: dict[str, object], world: int, interleave: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``case``'s K/V as a decode-context-parallel group of ``world`` ranks holds it (vLLM's slot
    mapping: `qsa_paged.DcpShard`): each rank's NaN-poisoned cache with its share of every
    request's positions, and the block table of entries spanning ``BS * world`` positions."""
    cache, table = case["kv_cache"], case["kv_block_table"]
    assert isinstance(cache, torch.Tensor) and isinstance(table, torch.Tensor)
    block_size = cache.shape[2]
    span = block_size * world
    per_request = -(-ATTENTION_MAX_LEN // span)
    virtual = (1 + torch.randperm(ATTENTION_REQUESTS * per_request, generator=GEN)).view(ATTENTION_REQUESTS, -1)
    pos = torch.arange(ATTENTION_MAX_LEN)
    offset = pos % span
    owner = (offset // interleave) % world
    row = offset // (world * interleave) * interleave + offset % interleave
    shares = []
    for rank in range(world):
        share, _ = strided_cache(1 + virtual.numel(), tuple(cache.shape[1:]), cache.dtype)
        mine = pos[owner == rank]
        for r in range(ATTENTION_REQUESTS):
            source = cache[table[r, mine // block_size].long(), :, (mine % block_size).to(DEVICE)]
            share[virtual[r, mine // span].to(DEVICE), :, row[owner == rank].to(DEVICE)] = source
        shares.append(share)
    return shares, virtual.int().to(DEVICE)


def check_dcp_attention() -> str:
    """Decode context parallelism: each rank's partials over its share of the keys (the group's
    query heads; torch, and Triton in one and three splits), merged with `merge_partials`, give
    the attention of the whole cache (`sparse_attention_torch`); a token whose keys all sit on
    other ranks gives empty partials."""
    cases, worst = 0, 0.0
    for index in (0, 1, 3, 4):  # sparse, head group of 3, 16 heads per KV head, dense
        for world, interleave in ((2, 1), (4, 1), (2, 2)):  # vLLM: the block size a multiple of the interleave
            shape = [(6, 4, 2, 16, 4, 3, 8, False), (5, 6, 2, 24, 3, 4, 6, False), (), (5, 16, 1, 16, 4, 2, 16, False),
                     (4, 4, 2, 16, 4, 3, 8, True)][index]  # fmt: skip
            tokens, heads, kv_heads, dim, ratio, topk, block_size, dense = shape
            case = attention_case(tokens, heads, kv_heads, dim, ratio, topk, block_size, torch.float32, dense)
            kwargs = {"ratio": ratio, "scale": dim**-0.5}
            want = qsa_paged.sparse_attention_torch(*case.values(), **kwargs)  # type: ignore[arg-type]
            shares, table = dcp_shares(case, world, interleave)
            q, gate = case["q"], case["gate"]
            assert isinstance(q, torch.Tensor) and isinstance(gate, torch.Tensor)
            rest = (table, case["token_req"], case["positions"], case["selected"])
            for backend, splits in (("torch", None), ("triton", 1), ("triton", 3)):
                parts = []
                for rank, share in enumerate(shares):
                    shard = qsa_paged.DcpShard(world, rank, interleave)
                    if backend == "torch":
                        parts.append(qsa_paged.sparse_attention_partials_torch(q, share, *rest, **kwargs, shard=shard))  # type: ignore[arg-type]
                    else:
                        parts.append(qsa_paged.sparse_attention_partials_triton(
                            q, share, *rest, **kwargs, shard=shard, num_splits=splits, block_n=16,  # type: ignore[arg-type]
                        ))  # fmt: skip
                acc = torch.cat([a for a, _ in parts])
                ml = torch.cat([m for _, m in parts])
                out = torch.full_like(want, float("nan"))
                qsa_paged.merge_partials(acc, ml, gate, out, backend="torch")
                assert not out.isnan().any(), f"dcp attention: NaN outputs ({backend}, world {world})"
                err = rel(out[:-2], want[:-2])
                assert err < 1e-5, f"dcp attention rel err {err:.3g} (case {index}, world {world}, {backend} {splits})"
                worst = max(worst, err)
                cases += 1
                # the Triton merge as vLLM's layer calls it: one rank's heads sliced out of the partials packed
                # [S, T, world * H, D + 2] as gathered (strided views), against the torch merge of the same heads
                packed = torch.cat([acc, ml], dim=-1).repeat(1, 1, world, 1)
                for rank in (0, world - 1):
                    mine = packed[:, :, rank * heads : (rank + 1) * heads]
                    merged = torch.full_like(want, float("nan"))
                    qsa_paged.merge_partials(mine[..., :dim], mine[..., dim:], gate, merged, backend="triton")
                    assert torch.equal(merged.isnan(), out.isnan()) and rel(merged, out) < 1e-6, (
                        f"triton merge, strided partials: rel err {rel(merged, out):.3g} (case {index}, world {world})"
                    )
    # a share without any of a token's keys: the merge weighs it 0
    acc = torch.zeros(2, 1, 1, 4, device=DEVICE)
    ml = torch.tensor([[[[qsa_paged.NO_KEYS_MAX, 0.0]]], [[[0.5, 2.0]]]], device=DEVICE)
    acc[1] = 2.0
    # and a token no share saw (padding) gets zeros; both from either merge
    empty_ml = torch.tensor([[[[qsa_paged.NO_KEYS_MAX, 0.0]]]] * 2, device=DEVICE)
    for backend in ("torch", "triton"):
        out = torch.empty(1, 4, device=DEVICE)
        qsa_paged.merge_partials(acc, ml, torch.full((1, 4), 50.0, device=DEVICE), out, backend=backend)
        assert torch.allclose(out, torch.ones(1, 4, device=DEVICE)), f"empty share weighed ({backend}): {out}"
        out = torch.full((1, 4), float("nan"), device=DEVICE)
        qsa_paged.merge_partials(torch.zeros(2, 1, 1, 4, device=DEVICE), empty_ml, torch.ones(1, 4, device=DEVICE),
                                 out, backend=backend)  # fmt: skip
        assert torch.equal(out, torch.zeros(1, 4, device=DEVICE)), f"padding token ({backend}): {out}"
    return f"{cases} cases, worst rel err {worst:.2e}"


def check_step_metadata() -> str:
    """A QSA group's per-step metadata: the one-launch kernel against the builder's torch ops,
    every buffer compared whole (rows past the step included), for each cache kind."""
    kinds = qsa_step_metadata.CacheKind
    cases = 0
    for query_lens, extra_tokens, ratio, block_size in [
        ([1], 0, 4, 16),
        ([1, 1, 1, 1, 1], 3, 4, 16),  # a padded decode batch (CUDA-graph padding tokens)
        ([7, 1, 12, 0, 3], 2, 8, 32),  # a mixed step, a request with no token this step
        ([40, 1], 0, 4, 8),
    ]:
        num_reqs = len(query_lens)
        lens = torch.tensor(query_lens)
        qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
        num_tokens = int(lens.sum()) + extra_tokens
        seq_lens = (lens + torch.randint(0, 90, (num_reqs,), generator=GEN)).to(torch.int32)
        table = torch.randint(1, 500, (num_reqs, 16), generator=GEN, dtype=torch.int32)
        slot_mapping = torch.randint(-1, 9000, (num_tokens,), generator=GEN)
        rows = num_tokens + 5
        for kind in kinds:
            capacity = 2 * ratio if kind is kinds.KEY_RING else block_size
            results = []
            for backend in ("torch", "triton"):
                buffers = {
                    "token_req": torch.full((rows,), 77, dtype=torch.int32),
                    "step_start": torch.full((num_reqs + 2,), 77, dtype=torch.int32),
                    "positions": torch.full((rows,), 77, dtype=torch.int64),
                    "slots": torch.full((rows,), 77, dtype=torch.int64),
                }
                buffers = {k: v.to(DEVICE) for k, v in buffers.items()}
                qsa_step_metadata.step_metadata(
                    kind, qsl.to(DEVICE), seq_lens.to(DEVICE), table.to(DEVICE), slot_mapping.to(DEVICE),
                    num_tokens, block_size=capacity, ratio=ratio, max_reqs=64, backend=backend, **buffers,
                )  # fmt: skip
                results.append(buffers)
            for name in results[0]:
                assert torch.equal(results[0][name], results[1][name]), f"{kind.name} {query_lens}: {name} differs"
            cases += 1
    return f"{cases} cases equal"


def check_imports_without_vllm() -> str:
    # this process imported torch, triton and qsa_paged only
    assert "vllm" not in sys.modules, "importing qwen38_plugin.ops.qsa_paged imported vllm"
    return "no vllm in sys.modules"


CHECKS: dict[str, Callable[[], str]] = {
    "write_kv": check_write_kv,
    "write_rows": check_write_rows,
    "index_scores": check_index_scores,
    "select_groups": check_select_groups,
    "group_keys": check_group_keys,
    "index_topk": check_index_topk,
    "sparse_attention": lambda: check_attention([1]),
    "merge_splits": lambda: check_attention([3], which=[0, 1, 4, 5]),
    "dcp_attention": check_dcp_attention,
    "step_metadata": check_step_metadata,
    "imports_without_vllm": check_imports_without_vllm,
}


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, DEVICE))
