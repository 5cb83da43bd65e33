"""QSA over vLLM's paged caches on CUDA (`ops.qsa_paged`): Triton path vs torch reference, and the roofline.

    PYTHONPATH=src/qwen38_plugin python3 benchmarks/qwen38_plugin/bench_qsa_paged.py [--dtypes bfloat16,float16]

One QSA layer at Flash-Next's attention geometry at TP1 (Hq 24, Hkv 2, D 256; read from stock
vLLM's comments, shared/docs/stock-vllm-matrix.md) with an indexer of Hi 16 heads of Di 128,
budget 2048 tokens, compress ratio 4 (assumed: no published config states the indexer sizes).
KV block size 64, key-ring capacity 4. Every request owns its own shuffled blocks.

Cases: decode steps of T = 1, 8, 64, 256 requests at contexts 4096 and 32768 (max_groups =
32768 // 4, the static bound a CUDA graph needs), and one 4096-token prefill. Columns:
- ``index`` = `index_topk` (Triton scores and selection), ``attn`` = `sparse_attention`, ``layer`` =
  K/V write, group keys, key and ring writes, index_topk and attention: one layer's QSA between its
  projections; ``slots`` = `slot_mappings`, once per step for all layers. Decode is timed as the
  median replay of a CUDA graph of 10 calls (launch gaps out); the prefill and every torch
  reference with ``triton.testing.do_bench`` (median). One more decode case runs with max_groups
  65536 (a server configured for 256K tokens) at a 32K context.
- ``torch`` = the same op through the plain-torch reference (``backend="torch"``), same inputs.
- ``need MB`` = bytes the step cannot avoid moving: each token's K/V rows it attends to, the key
  cache rows its selection scores (its complete groups, only when past the budget), its queries
  (q, gate, index q) and output; ``frac`` = need / (layer time * copy bandwidth), the copy
  bandwidth a 1 GiB device-to-device copy reaches in this run (bytes read + written per second).
  The index's own fp32 scores row (written, then read by the selection) is overhead, not need.
- ``check``: Triton vs the torch reference on these inputs: rows whose selection is identical,
  and the attention's max rel err given the same selection.
Prints one table; with ``$OUT`` set, also writes it to ``$OUT/bench_qsa_paged.txt``.

``--dcp 2`` adds the reference deployment's TP4 / DCP2 attention per rank at decode (a second table):
a rank of TP4 without DCP (6 query heads over its KV head's whole K/V: `sparse_attention`) against a
rank of its DCP pair (the pair's 12 gathered query heads over half of the positions:
`sparse_attention_partials` with ``DcpShard(2, 0)``, then `merge_partials` of the two ranks'
partials); ``frac`` = the K/V bytes each must read over its time and the copy bandwidth. The
gathers between the ranks (NCCL) are not in it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src" / "qwen38_plugin"))

from qwen38_plugin.ops import qsa_paged

HQ, HKV, D, HI, DI, RATIO, BUDGET, BLOCK, RING = 24, 2, 256, 16, 128, 4, 2048, 64, 4
TOPK = BUDGET // RATIO
ROTARY, THETA, EPS = 64, 10_000_000.0, 1e-6


def median_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graph_ms(fn: Callable[[], Any], inner: int = 10, repeats: int = 20) -> float:
    """Median ms per call of ``inner`` calls captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / inner)
    return statistics.median(samples)


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(2**29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (median_ms(lambda: dst.copy_(src)) * 1e-3)


class Caches:
    """Caches for ``requests`` requests of up to ``max_len`` positions each, filled with random
    values (every request's blocks shuffled over the pool), reused by every case."""

    def __init__(self, requests: int, max_len: int, dtype: torch.dtype, gen: torch.Generator) -> None:
        per = -(-(max_len + 1) // BLOCK)
        self.kv = torch.empty(1 + requests * per, HKV, BLOCK, 2 * D, dtype=dtype, device="cuda").normal_(generator=gen)
        self.key = torch.empty(1 + requests * per, 1, BLOCK // RATIO, DI, dtype=dtype, device="cuda")
        self.key.normal_(generator=gen)
        self.ring = torch.empty(1 + requests, 1, RING, DI, dtype=dtype, device="cuda").normal_(generator=gen)
        ids = 1 + torch.randperm(requests * per, device="cuda", generator=gen)
        self.kv_table = ids.view(requests, per).int()
        self.key_table = (1 + torch.randperm(requests * per, device="cuda", generator=gen)).view(requests, per).int()
        self.ring_block = (1 + torch.arange(requests, device="cuda")).int()


def step_inputs(
    caches: Caches, lengths: list[int], counts: list[int], dtype: torch.dtype, gen: torch.Generator
) -> dict[str, Any]:
    """A step of ``counts[r]`` tokens for request r whose sequence reaches ``lengths[r]``."""
    rows = len(lengths)
    counts_t = torch.tensor(counts, device="cuda")
    token_req = torch.arange(rows, device="cuda").repeat_interleave(counts_t).int()
    seq_lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    step_start = seq_lens - counts_t.int()
    first = torch.cumsum(counts_t, 0) - counts_t
    positions = step_start.long()[token_req] + torch.arange(token_req.shape[0], device="cuda") - first[token_req]
    t = token_req.shape[0]

    def r(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(dt)

    return {
        "token_req": token_req, "positions": positions, "seq_lens": seq_lens, "step_start": step_start,
        "kv_table": caches.kv_table[:rows], "key_table": caches.key_table[:rows],
        "ring_block": caches.ring_block[:rows],
        "q": r(t, HQ, D), "gate": r(t, HQ * D), "k": r(t, HKV, D), "v": r(t, HKV, D),
        "index_q": r(t, HI, DI, dt=torch.float32), "raw_keys": r(t, DI), "k_norm": r(DI) * 0.1,
    }  # fmt: skip


def run_index(c: Caches, x: dict[str, Any], max_groups: int, backend: str) -> torch.Tensor:
    return qsa_paged.index_topk(x["index_q"], c.key, x["key_table"], x["token_req"], x["positions"], ratio=RATIO,
                                topk=TOPK, max_groups=max_groups, backend=backend)  # fmt: skip


def run_attention(c: Caches, x: dict[str, Any], selected: torch.Tensor, backend: str) -> torch.Tensor:
    return qsa_paged.sparse_attention(x["q"], x["gate"], c.kv, x["kv_table"], x["token_req"], x["positions"], selected,
                                      ratio=RATIO, scale=D**-0.5, backend=backend)  # fmt: skip


def run_slots(x: dict[str, Any]) -> qsa_paged.SlotMappings:
    return qsa_paged.slot_mappings(x["token_req"], x["positions"], x["seq_lens"], x["kv_table"], block_size=BLOCK,
                                   key_block_table=x["key_table"], ring_block=x["ring_block"], ratio=RATIO,
                                   ring_capacity=RING)  # fmt: skip


def run_layer(c: Caches, x: dict[str, Any], slots: qsa_paged.SlotMappings, max_groups: int) -> torch.Tensor:
    """One QSA layer of a step between its projections (the slot mappings are the step's, made once)."""
    assert slots.key is not None and slots.ring is not None
    qsa_paged.write_kv(c.kv, slots.kv, x["k"], x["v"])
    keys = qsa_paged.group_keys(x["raw_keys"], c.ring, x["ring_block"], x["token_req"], x["positions"], x["step_start"],
                                ratio=RATIO, k_norm_weight=x["k_norm"], eps=EPS, rope_theta=THETA,
                                rotary_dim=ROTARY)  # fmt: skip
    qsa_paged.write_rows(c.key, slots.key, keys)
    qsa_paged.write_rows(c.ring, slots.ring, x["raw_keys"])
    return run_attention(c, x, run_index(c, x, max_groups, "auto"), "auto")


def attended_keys(x: dict[str, Any]) -> torch.Tensor:
    """How many K/V positions each token of the step attends to: its selection and open group past
    the budget, every earlier position below it."""
    pos = x["positions"].long()
    complete = (pos + 1) // RATIO
    return torch.where(complete > TOPK, TOPK * RATIO + (pos + 1 - complete * RATIO), pos + 1)


def needed_bytes(x: dict[str, Any], elem: int) -> int:
    pos = x["positions"].long()
    complete = (pos + 1) // RATIO
    keys = attended_keys(x)
    scanned = torch.where(complete > TOPK, complete, 0)
    t = pos.shape[0]
    per_token = (3 * HQ * D + 2 * HKV * D + DI) * elem + HI * DI * 4  # q, gate, out; k, v; raw key; index q
    return int(keys.sum()) * HKV * 2 * D * elem + int(scanned.sum()) * DI * elem + t * per_token


def case(caches: Caches, label: str, lengths: list[int], counts: list[int], dtype: torch.dtype, decode: bool,
         bandwidth: float, gen: torch.Generator, max_model_len: int = 32768) -> str:  # fmt: skip
    max_groups = max_model_len // RATIO
    x = step_inputs(caches, lengths, counts, dtype, gen)
    elem = torch.finfo(dtype).bits // 8
    # checks first (Triton vs torch on the same inputs; the same selection for the attention)
    sel_triton = run_index(caches, x, max_groups, "triton")
    sel_torch = run_index(caches, x, max_groups, "torch")
    same_rows = float((sel_triton == sel_torch).all(1).float().mean())
    out_triton = run_attention(caches, x, sel_torch, "triton")
    out_torch = run_attention(caches, x, sel_torch, "torch")
    err = float((out_triton.float() - out_torch.float()).abs().max() / out_torch.float().abs().max())
    timer = graph_ms if decode else median_ms
    index_ms = timer(lambda: run_index(caches, x, max_groups, "triton"))
    attn_ms = timer(lambda: run_attention(caches, x, sel_triton, "triton"))
    slots = run_slots(x)
    slots_ms = timer(lambda: run_slots(x))
    layer_ms = timer(lambda: run_layer(caches, x, slots, max_groups))  # rewrites the step's rows: same values
    torch_index_ms = median_ms(lambda: run_index(caches, x, max_groups, "torch"))
    torch_attn_ms = median_ms(lambda: run_attention(caches, x, sel_torch, "torch"))
    need = needed_bytes(x, elem)
    frac = need / (layer_ms * 1e-3 * bandwidth)
    t = int(x["token_req"].shape[0])
    dt = str(dtype).removeprefix("torch.")
    return (
        f"{label:<24}{dt:<9}{t:>6}{index_ms:>9.3f}{attn_ms:>9.3f}{layer_ms:>9.3f}{slots_ms:>8.3f}{torch_index_ms:>10.3f}"
        f"{torch_attn_ms:>10.3f}{need / 1e6:>10.1f}{frac:>7.2f}   {same_rows:.3f} / {err:.1e}"
    )


def dcp_case(caches: Caches, context: int, requests: int, dtype: torch.dtype, bandwidth: float,
             gen: torch.Generator) -> str:  # fmt: skip
    """One decode step of ``requests`` at ``context`` for a TP4 rank, without and with DCP 2."""
    x = step_inputs(caches, [context + 1] * requests, [1] * requests, dtype, gen)
    selected = run_index(caches, x, 32768 // RATIO, "triton")
    kv = caches.kv[:, :1]  # the rank's one KV head
    heads = HQ // 4
    common = (x["kv_table"], x["token_req"], x["positions"], selected)
    q_rank, gate_rank = x["q"][:, :heads], x["gate"][:, : heads * D]
    q_pair = x["q"][:, : 2 * heads]
    shard = qsa_paged.DcpShard(2, 0)

    def plain() -> torch.Tensor:
        return qsa_paged.sparse_attention(q_rank, gate_rank, kv, *common, ratio=RATIO, scale=D**-0.5)

    def partials() -> tuple[torch.Tensor, torch.Tensor]:
        return qsa_paged.sparse_attention_partials(q_pair, kv, *common, ratio=RATIO, scale=D**-0.5, shard=shard)

    acc, ml = partials()
    acc2, ml2 = torch.cat([acc, acc]), torch.cat([ml, ml])  # the pair's partials, as gathered
    out = torch.empty_like(gate_rank)

    def merge() -> torch.Tensor:
        return qsa_paged.merge_partials(acc2[:, :, :heads], ml2[:, :, :heads], gate_rank, out)

    plain_ms, partials_ms, merge_ms = graph_ms(plain), graph_ms(partials), graph_ms(merge)
    keys = int(attended_keys(x).sum())
    elem = torch.finfo(dtype).bits // 8
    full, half = keys * 2 * D * elem, keys * D * elem  # K/V rows of one KV head: all of them, half of them
    frac_plain = full / (plain_ms * 1e-3 * bandwidth)
    frac_dcp = half / ((partials_ms + merge_ms) * 1e-3 * bandwidth)
    dt = str(dtype).removeprefix("torch.")
    label = f"decode ctx {context}"
    return (f"{label:<24}{dt:<9}{requests:>6}{plain_ms:>10.3f}{frac_plain:>7.2f}{partials_ms:>10.3f}"
            f"{merge_ms:>9.3f}{frac_dcp:>7.2f}{(partials_ms + merge_ms) / plain_ms:>9.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--dcp", type=int, default=0, choices=(0, 2), help="2: the TP4 / DCP2 table too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_qsa_paged: no CUDA device here; run it on a CUDA machine (nothing measured)")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    lines = [
        f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; copy {bandwidth / 1e12:.2f} TB/s "
        f"(read + write, 1 GiB); Hq {HQ} Hkv {HKV} D {D} Hi {HI} Di {DI} ratio {RATIO} budget {BUDGET} "
        f"block {BLOCK} (times in ms; decode: CUDA-graph replay, else do_bench median)",
        f"{'case':<24}{'dtype':<9}{'T':>6}{'index':>9}{'attn':>9}{'layer':>9}{'slots':>8}{'torch idx':>10}"
        f"{'torch att':>10}{'need MB':>10}{'frac':>7}   check: same sel rows / attn rel err",
    ]
    print("\n".join(lines), flush=True)
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        caches = Caches(256, 32768 + 1, dtype, gen)
        for context in (4096, 32768):
            for requests in (1, 8, 64, 256):
                label = f"decode ctx {context}"
                line = case(caches, label, [context + 1] * requests, [1] * requests, dtype, True, bandwidth, gen)
                print(line, flush=True)
                lines.append(line)
        # a server configured for 256K tokens: max_groups 65536, past what the selection holds in registers
        line = case(caches, "decode ctx 32768 mml256K", [32769] * 64, [1] * 64, dtype, True, bandwidth, gen, 262144)
        print(line, flush=True)
        lines.append(line)
        line = case(caches, "prefill 4096", [4096], [4096], dtype, False, bandwidth, gen)
        print(line, flush=True)
        lines.append(line)
        if args.dcp:
            header = (f"{'TP4 rank, DCP 2':<24}{'dtype':<9}{'T':>6}{'tp4 attn':>10}{'frac':>7}{'dcp part':>10}"
                      f"{'merge':>9}{'frac':>7}{'dcp/tp4':>9}")  # fmt: skip
            print(header, flush=True)
            lines.append(header)
            for context in (4096, 32768):
                for requests in (1, 8, 64):
                    line = dcp_case(caches, context, requests, dtype, bandwidth, gen)
                    print(line, flush=True)
                    lines.append(line)
        del caches
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_qsa_paged.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
