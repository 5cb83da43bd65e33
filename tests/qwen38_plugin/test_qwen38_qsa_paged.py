"""`ops.qsa_paged` (a whole step's QSA over vLLM's paged caches) against `ops.qsa`'s per-sequence ring form.

- A simulated serving run: several requests of different lengths (one shorter than a group, one
  past the budget, a prefill over several blocks, chunked prefills continuing earlier steps so
  that group keys draw on the ring, decode steps), rows in a different order each step, padding
  tokens, caches with shuffled block ids and a dim 0 strided past one page, NaN-poisoned. Per
  step, the paged ops must select exactly the oracle's tokens and give its outputs; at the end
  the caches must hold exactly the oracle's tensors (and nothing else was written).
- `slot_mappings` against a per-token loop; `index_topk`'s documented tie rule.
- The Triton kernels against the torch references, outputs poisoned first
  (qsa_paged_triton_check.py: under ``TRITON_INTERPRET=1`` on CPU, natively on a CUDA machine).
- Each Triton kernel compiles for sm_70 (no tensor cores: FMA) and sm_90 on CPU, no GPU needed
  (qsa_paged_compile_check.py). The two scripts run side by side in subprocesses.
- On CUDA (skipped elsewhere, saying why): the Triton path against the oracle in fp32, fp16 and
  bf16, and one decode step captured in a CUDA graph and replayed equals the same step run eagerly.
  On a GPU machine without vLLM (the whole file, 46 tests, ran there in 66 s on the H200:
  benchmarks/qwen38_plugin/results/qsa_paged_cuda_checks.txt):

    PYTHONPATH=src/qwen38_plugin:. python3 -m pytest --noconftest -q -rA -s tests/qwen38_plugin/test_qwen38_qsa_paged.py

Error measure: max |ours - oracle| / max |oracle| over a step's outputs. Tolerances:
- fp32: 1e-5 (the same fp32 arithmetic in another summation order);
- fp16 / bf16: both sides compute the attention in fp32 and round it, then the gate product, to
  the format, so they may differ by an ulp at each rounding: 2 ulps of the format relative to the
  largest output (2 * 2^-10 for fp16, 2 * 2^-7 for bf16) on the torch path; the Triton path also
  rounds the softmax probabilities to the format for its P @ V product (as flash attention does):
  4 ulps there.
Selections are compared exactly. A group scores exactly 0 when every index head's dot with it is
negative; on the torch path `index_topk` resolves ties at the budget's edge as the oracle's
torch.topk does, on the Triton path to the lowest groups (`index_topk`'s docstring); with 4 to 8
index heads on random data such ties are rare enough not to occur here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from qwen38_plugin.ops import qsa_paged
from tests.qwen38_plugin import qsa_paged_compile_check as compile_check
from tests.qwen38_plugin.qsa_paged_harness import (
    Geometry,
    OracleRun,
    PagedRun,
    expected_storages,
    random_step,
    selection_mask,
)

HERE = Path(__file__).resolve().parent
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device (Triton kernels natively, CUDA graphs); none here"
)

GEOMETRIES = {
    # ratio 4, GQA 2, power-of-two sizes; 16-token blocks hold 4 group keys; an 8-row ring
    "r4": Geometry(heads=4, kv_heads=2, dim=16, index_heads=4, index_dim=16, ratio=4, topk=3, block_size=16,
                   ring_capacity=8, rotary_dim=8, max_len=64),
    # ratio 3, GQA 3, head sizes that are no power of two, 12-token blocks, a ring of two groups
    "r3": Geometry(heads=6, kv_heads=2, dim=24, index_heads=8, index_dim=12, ratio=3, topk=2, block_size=12,
                   ring_capacity=6, rotary_dim=4, max_len=60),
    # ratio 1: every token closes its group, the open group is always empty; MHA
    "r1": Geometry(heads=2, kv_heads=2, dim=8, index_heads=8, index_dim=8, ratio=1, topk=5, block_size=8,
                   ring_capacity=2, rotary_dim=8, max_len=48),
}  # fmt: skip
# (request, tokens) per step, rows in this order, then padding tokens.
STEPS: list[tuple[list[tuple[int, int]], int]] = [
    ([(0, 2), (1, 37), (2, 10)], 2),  # 2 tokens: less than a group; 37: several blocks, past the budget
    ([(0, 1), (1, 1), (2, 11), (3, 1)], 3),  # request 2's chunk starts inside a group (its head is in the ring)
    ([(1, 1), (0, 1), (2, 1), (3, 5), (4, 6)], 0),  # rows no longer in request order
    ([(4, 1), (3, 1), (2, 1), (1, 1), (0, 1)], 3),
    ([(2, 7), (4, 7), (1, 1)], 1),
    ([(0, 1), (4, 1), (2, 1)], 2),
]
TOL_TORCH = {torch.float32: 1e-5, torch.float16: 2 * 2**-10, torch.bfloat16: 2 * 2**-7}
TOL_TRITON = {torch.float32: 1e-5, torch.float16: 4 * 2**-10, torch.bfloat16: 4 * 2**-7}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.float().cpu(), expected.float().cpu()
    assert torch.isfinite(actual).all(), "non-finite output"
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def simulate(
    geo: Geometry, dtype: torch.dtype, device: str, backend: str, seed: int, tol: float, exact_caches: bool
) -> list[str]:
    """Run `STEPS` on both sides; assert per step and at the end; return one line per step."""
    gen = torch.Generator().manual_seed(seed)
    num_requests = 1 + max(r for step, _ in STEPS for r, _ in step)
    k_norm_weight = (torch.randn(geo.index_dim, generator=gen) * 0.2).to(dtype)
    paged = PagedRun(geo, num_requests, dtype, device, gen, k_norm_weight.to(device), backend=backend)
    oracle = OracleRun(geo, num_requests, k_norm_weight)
    initial = {name: t.cpu().clone() for name, t in paged.storages.items()}
    lines = []
    for number, (rows, padding) in enumerate(STEPS):
        requests = [r for r, _ in rows]
        counts = [n for _, n in rows]
        starts = [paged.lengths[r] for r in requests]
        tokens = random_step(geo, requests, counts, starts, dtype, gen)
        out, selected = paged.step(tokens, padding)
        expected_out, masks = oracle.step(tokens)
        first = 0
        for r, count, start, mask in zip(requests, counts, starts, masks, strict=True):
            got = selection_mask(
                selected[first : first + count], torch.arange(start, start + count), geo.ratio, start + count
            )
            assert torch.equal(got, mask), f"step {number} request {r}: selection differs from the oracle's"
            first += count
        err = rel(out, torch.cat(expected_out))
        assert err < tol, f"step {number}: rel err {err:.3g} >= {tol:.3g}"
        lines.append(f"step {number}: {sum(counts)} tokens + {padding} padding, rel err {err:.2e}")
    expected = expected_storages(paged, oracle, initial)
    for name, storage in paged.storages.items():
        if exact_caches or name != "key":
            torch.testing.assert_close(storage.cpu(), expected[name], rtol=0, atol=0, equal_nan=True, msg=name)
        else:  # group keys computed on another device: the same formula, other roundings
            got, want = storage.cpu(), expected[name]
            assert torch.equal(got.isnan(), want.isnan()), "key cache: rows written where the oracle has none"
            assert rel(got.nan_to_num(), want.nan_to_num()) < tol, "key cache differs from the oracle's group keys"
    return lines


# ratio 1 in fp32 only: the half dtypes add nothing ratio-specific
TORCH_CASES = [(g, d) for g in GEOMETRIES for d in DTYPES if g != "r1" or d == "float32"]


@pytest.mark.parametrize(("geometry", "dtype"), TORCH_CASES)
def test_paged_steps_match_per_sequence_reference(geometry: str, dtype: str) -> None:
    seed = list(GEOMETRIES).index(geometry) * 10 + list(DTYPES).index(dtype)
    simulate(
        GEOMETRIES[geometry], DTYPES[dtype], "cpu", "torch", seed=seed, tol=TOL_TORCH[DTYPES[dtype]], exact_caches=True
    )


def test_slot_mappings_match_a_per_token_loop() -> None:
    gen = torch.Generator().manual_seed(3)
    block_size, ratio, capacity = 8, 4, 8
    starts, counts = [5, 0, 17, 30], [1, 13, 4, 1]
    tables = [1 + torch.randperm(40, generator=gen)[:24].view(4, 6) for _ in range(2)]
    ring_block = 1 + torch.randperm(6, generator=gen)[:4]
    token_req = [r for r, n in enumerate(counts) for _ in range(n)] + [-1, -1]
    positions = [s + i for s, n in zip(starts, counts, strict=True) for i in range(n)] + [0, 3]
    seq_lens = [s + n for s, n in zip(starts, counts, strict=True)]
    got = qsa_paged.slot_mappings(
        torch.tensor(token_req, dtype=torch.int32),
        torch.tensor(positions),
        torch.tensor(seq_lens, dtype=torch.int32),
        tables[0].int(),
        block_size=block_size,
        key_block_table=tables[1].int(),
        ring_block=ring_block.int(),
        ratio=ratio,
        ring_capacity=capacity,
    )
    assert got.key is not None and got.ring is not None
    for t, (r, p) in enumerate(zip(token_req, positions, strict=True)):
        if r < 0:
            assert (got.kv[t], got.key[t], got.ring[t]) == (-1, -1, -1)
            continue
        assert got.kv[t] == tables[0][r, p // block_size] * block_size + p % block_size
        g, per_block = p // ratio, block_size // ratio
        want_key = tables[1][r, g // per_block] * per_block + g % per_block if (p + 1) % ratio == 0 else -1
        assert got.key[t] == want_key
        assert got.ring[t] == (ring_block[r] * capacity + p % capacity if p >= seq_lens[r] - capacity else -1)
    assert got.kv.dtype == got.key.dtype == got.ring.dtype == torch.int64
    no_indexer = qsa_paged.slot_mappings(
        torch.tensor(token_req, dtype=torch.int32),
        torch.tensor(positions),
        torch.tensor(seq_lens),
        tables[0].int(),
        block_size=block_size,
    )
    assert torch.equal(no_indexer.kv, got.kv) and no_indexer.key is None and no_indexer.ring is None


def _one_request_key_cache(keys: torch.Tensor, rows_per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A key cache holding ``keys [G, Di]`` as groups 0..G-1 of request 0, blocks in reverse order."""
    blocks = -(-keys.shape[0] // rows_per_block)
    cache = torch.full((blocks + 1, 1, rows_per_block, keys.shape[1]), float("nan"))
    table = torch.arange(blocks, 0, -1, dtype=torch.int32)[None, :]
    g = torch.arange(keys.shape[0])
    cache[table[0, g // rows_per_block].long(), 0, g % rows_per_block] = keys
    return cache, table


def test_index_topk_ties_choose_as_transformers() -> None:
    # 10 complete groups, budget 4: groups 2 and 7 score above the others, which all tie exactly
    # (identical keys). Both are chosen, and of the tied groups those transformers' indexer
    # chooses: torch.topk over exactly the 10 complete groups (the Triton path takes the lowest
    # tied groups instead: qsa_paged_triton_check.py's select_groups).
    gen = torch.Generator().manual_seed(5)
    common, special = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    keys = common.expand(10, 16).clone()
    keys[[2, 7]] = common + special
    q = torch.stack([common + special, common])[None]  # [1, 2 heads, 16]: both favour groups 2 and 7
    cache, table = _one_request_key_cache(keys, rows_per_block=4)
    scores = (q[0] @ keys.T).relu().sum(0)
    others = scores[[0, 1, 3, 4, 5, 6, 8, 9]]
    assert scores[2] == scores[7] and scores[2] > scores[0] and bool((others == scores[0]).all())
    selected = qsa_paged.index_topk(
        q,
        cache,
        table,
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([41]),
        ratio=4,
        topk=4,
        max_groups=16,
        backend="torch",
    )[0].tolist()
    oracle = sorted(scores.topk(4).indices.tolist())
    assert selected == oracle and {2, 7} <= set(selected)


def test_index_topk_below_the_budget_selects_every_complete_group() -> None:
    cache, table = _one_request_key_cache(torch.randn(6, 8), rows_per_block=4)
    q = torch.randn(3, 2, 8)
    positions = torch.tensor([2, 9, 13])  # 0, 2 and 3 complete groups with ratio 4
    token_req = torch.tensor([0, 0, -1], dtype=torch.int32)  # the last token is padding
    selected = qsa_paged.index_topk(
        q, cache, table, token_req, positions, ratio=4, topk=3, max_groups=16, backend="torch"
    )
    assert selected.tolist() == [[-1, -1, -1], [0, 1, -1], [-1, -1, -1]] and selected.dtype == torch.int32


def test_index_topk_in_row_chunks_equals_all_rows_at_once() -> None:
    # max_score_bytes bounds the [rows, max_groups] scores: 3 rows per chunk must change nothing
    gen = torch.Generator().manual_seed(9)
    cache, table = _one_request_key_cache(torch.randn(40, 8, generator=gen), rows_per_block=4)
    q = torch.randn(11, 3, 8, generator=gen)
    positions = torch.randint(0, 160, (11,), generator=gen)
    token_req = torch.zeros(11, dtype=torch.int32)
    args = (q, cache, table, token_req, positions)
    whole = qsa_paged.index_topk(*args, ratio=4, topk=5, max_groups=40, backend="torch")
    chunked = qsa_paged.index_topk(*args, ratio=4, topk=5, max_groups=40, backend="torch", max_score_bytes=3 * 4 * 40)
    assert torch.equal(whole, chunked) and bool((positions >= 23).any())  # some rows past the budget


def test_dispatch_picks_triton_for_cuda_only_and_obeys_the_reference_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(1)
    assert not qsa_paged.use_triton(x)
    assert not qsa_paged.use_triton(x, "torch")
    with pytest.raises(ValueError, match="backend must be one of"):
        qsa_paged.use_triton(x, "cuda")
    if HAS_CUDA and qsa_paged.HAVE_TRITON:
        y = x.cuda()
        assert qsa_paged.use_triton(y)
        monkeypatch.setenv(qsa_paged.REFERENCE_ENV, "1")
        assert not qsa_paged.use_triton(y) and qsa_paged.use_triton(y, "triton")


# --------------------------------------------------------------------------------------------
# Triton under the interpreter, and code generation for sm_70 / sm_90
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def check_reports() -> dict[str, dict[str, str]]:
    """Verdict lines ("PASS name ..." / "FAIL name ...") of the two check scripts, run side by side
    in subprocesses: the kernel checks (under the interpreter without CUDA: TRITON_INTERPRET is
    read when a kernel is decorated; natively on a CUDA machine, whose Triton 3.6 interpreter
    (the H200 image's) failed on loops bounded by loaded values) and the compiles."""
    kernels_env = {} if HAS_CUDA else {"TRITON_INTERPRET": "1"}
    scripts = {
        "kernels": ("qsa_paged_triton_check.py", kernels_env),
        "compile": ("qsa_paged_compile_check.py", {}),
    }
    procs = {
        kind: subprocess.Popen(
            [sys.executable, str(HERE / script)],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for kind, (script, env) in scripts.items()
    }
    reports = {}
    for kind, proc in procs.items():
        log, _ = proc.communicate(timeout=300)
        report = {m.group(2): m.group(0) for m in re.finditer(r"^(PASS|FAIL) (\S+).*$", log, re.MULTILINE)}
        report["__log__"] = log
        reports[kind] = report
    return reports


KERNEL_CHECKS = [
    "write_kv",
    "select_groups",
    "group_keys",
    "write_rows",
    "index_scores",
    "index_topk",
    "sparse_attention",
    "merge_splits",
    "dcp_attention",
    "step_metadata",
    "imports_without_vllm",
]


@pytest.mark.parametrize("check", KERNEL_CHECKS)
def test_triton_kernels_match_torch(check_reports: dict[str, dict[str, str]], check: str) -> None:
    """Under TRITON_INTERPRET=1 on CPU; natively on CUDA (`check_reports`)."""
    report = check_reports["kernels"]
    line = report.get(check)
    assert line is not None, f"check {check} did not report:\n{report['__log__'][-4000:]}"
    assert line.startswith("PASS"), line


COMPILES = [f"sm{c}-{d}/{name}" for c, d, names in compile_check.COMPILES for name in names]


@pytest.mark.skipif(not qsa_paged.HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("target", COMPILES)
def test_triton_kernels_compile_for_sm70_and_sm90(check_reports: dict[str, dict[str, str]], target: str) -> None:
    report = check_reports["compile"]
    line = report.get(target)
    assert line is not None, f"compile {target} did not report:\n{report['__log__'][-4000:]}"
    assert line.startswith("PASS"), line


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", ["r4", "r3"])
def test_triton_paged_steps_on_cuda_match_per_sequence_reference(geometry: str, dtype: str) -> None:
    lines = simulate(
        GEOMETRIES[geometry],
        DTYPES[dtype],
        "cuda",
        "triton",
        seed=11,
        tol=TOL_TRITON[DTYPES[dtype]],
        exact_caches=False,
    )
    print(f"\n{geometry} {dtype} triton on cuda: " + "; ".join(lines))


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_step_replayed_from_a_cuda_graph_equals_eager(dtype: str) -> None:
    # Flash-Next's attention sizes; max_len 40000 makes max_groups 10000: rows longer than the
    # selection kernel holds in registers (its torch.topk threshold path, captured too).
    geo = Geometry(heads=24, kv_heads=2, dim=256, index_heads=16, index_dim=128, ratio=4, topk=64, block_size=64,
                   ring_capacity=4, rotary_dim=64, max_len=40000)  # fmt: skip
    torch_dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(21)
    requests = 6
    paged = PagedRun(
        geo,
        requests,
        torch_dtype,
        "cuda",
        gen,
        torch.randn(geo.index_dim, generator=gen).to(torch_dtype).cuda(),
        backend="triton",
    )
    # Fill the caches with a prefill per request (lengths around and past the budget), eagerly.
    lengths = [3, 200, 257, 1023, 600, 64]
    paged.step(random_step(geo, list(range(requests)), lengths, [0] * requests, torch_dtype, gen), padding=0)
    # One decode step (2 padding rows), as tensors the graph reads from static buffers.
    step = random_step(geo, list(range(requests)), [1] * requests, lengths, torch_dtype, gen)
    decode = _decode_inputs(paged, step, padding=2)
    storages = {name: t.clone() for name, t in paged.storages.items()}
    eager = _decode_step(paged, decode)
    eager_storages = {name: t.clone() for name, t in paged.storages.items()}
    for name, t in storages.items():  # the step again from the same caches, captured then replayed
        paged.storages[name].copy_(t)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        _decode_step(paged, decode)
    torch.cuda.current_stream().wait_stream(side)
    for name, t in storages.items():
        paged.storages[name].copy_(t)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _decode_step(paged, decode)
    for name, t in storages.items():
        paged.storages[name].copy_(t)
    captured[0].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[1], eager[1]), "selections differ between graph replay and eager"
    assert torch.equal(captured[0], eager[0]), "outputs differ between graph replay and eager"
    for name, t in eager_storages.items():
        torch.testing.assert_close(paged.storages[name], t, rtol=0, atol=0, equal_nan=True, msg=name)


def _decode_inputs(paged: PagedRun, step: Any, padding: int) -> dict[str, Any]:
    geo, dev = paged.geo, "cuda"
    rows = len(step.requests)
    token_req = torch.cat([torch.arange(rows), torch.full((padding,), -1)]).to(torch.int32)
    positions = torch.cat([torch.tensor(step.starts), torch.zeros(padding, dtype=torch.long)])
    ids = torch.tensor(step.requests)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.randn(padding, *x.shape[1:]).to(x.dtype)]).to(dev)

    return {
        "token_req": token_req.to(dev),
        "positions": positions.to(dev),
        "seq_lens": (torch.tensor(step.starts) + 1).to(torch.int32).to(dev),
        "step_start": torch.tensor(step.starts, dtype=torch.int32).to(dev),
        "kv_table": paged.kv_table[ids].int().to(dev),
        "key_table": paged.key_table[ids].int().to(dev),
        "ring_block": paged.ring_ids[ids].int().to(dev),
        **{name: pad(getattr(step, name)) for name in ("q", "gate", "k", "v", "index_q", "raw_keys")},
        "geo": geo,
    }


def _decode_step(paged: PagedRun, x: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot mappings, writes, group keys, selection and attention: everything a captured step runs."""
    from tests.qwen38_plugin.qsa_paged_harness import EPS, ROPE_THETA

    geo: Geometry = x["geo"]
    slots = qsa_paged.slot_mappings(
        x["token_req"],
        x["positions"],
        x["seq_lens"],
        x["kv_table"],
        block_size=geo.block_size,
        key_block_table=x["key_table"],
        ring_block=x["ring_block"],
        ratio=geo.ratio,
        ring_capacity=geo.ring_capacity,
    )
    assert slots.key is not None and slots.ring is not None
    qsa_paged.write_kv(paged.kv_cache, slots.kv, x["k"], x["v"])
    keys = qsa_paged.group_keys(
        x["raw_keys"],
        paged.ring_cache,
        x["ring_block"],
        x["token_req"],
        x["positions"],
        x["step_start"],
        ratio=geo.ratio,
        k_norm_weight=paged.k_norm_weight,
        eps=EPS,
        rope_theta=ROPE_THETA,
        rotary_dim=geo.rotary_dim,
    )
    qsa_paged.write_rows(paged.key_cache, slots.key, keys)
    qsa_paged.write_rows(paged.ring_cache, slots.ring, x["raw_keys"])
    selected = qsa_paged.index_topk(
        x["index_q"],
        paged.key_cache,
        x["key_table"],
        x["token_req"],
        x["positions"],
        ratio=geo.ratio,
        topk=geo.topk,
        max_groups=geo.max_groups,
    )
    out = qsa_paged.sparse_attention(
        x["q"],
        x["gate"],
        paged.kv_cache,
        x["kv_table"],
        x["token_req"],
        x["positions"],
        selected,
        ratio=geo.ratio,
        scale=geo.dim**-0.5,
    )
    return out, selected
