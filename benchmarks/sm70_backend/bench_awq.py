"""SM70 AWQ W4A16 kernels on a CUDA GPU against torch dequantize-then-matmul and the ceilings measured
there, plus the V100 roofline estimate for the AWQ MoE at the Flash-Next geometry.

    PYTHONPATH=src/sm70_backend:. python benchmarks/sm70_backend/bench_awq.py [--estimate-only]

Measured table (one run, one GPU), per case: ``ours`` = `kernels.awq` (decode gemv for M <= 8, else
the tensor-core gemm; MoE: sorting + two gemms + SiLU), median of CUDA-graph replays; ``deq+mm`` =
torch: `awq_reference.dequantize` then ``torch.matmul`` (MoE: the reference's loop over experts,
eager, no graph); ``mm fp16`` = ``torch.matmul`` on the already dequantized fp16 weight (cuBLAS:
what an fp16 checkpoint costs); ``need MB`` = packed weights, scales and zeros read once plus x and
out; ``copy frac`` = need / (ours * copy bandwidth measured here, a 1 GiB device-to-device copy);
``fp16 frac`` = FLOPs / (ours * fp16 matmul rate measured here, an 8192^3 torch.matmul); ``err`` =
max|ours - reference| / max|reference|.

On sm_90 the m8n8k4 instruction of the prefill kernel is emulated (test_awq_compile.py), so H200
timings check that nothing is pathologically slow; they do not measure V100 speed. The V100 estimate
is the roofline max(bytes / 900 GB/s, FLOPs / 125 TFLOP/s) for one Flash-Next MoE layer (hidden
2560, 512 experts, top-10, expert intermediate 512; ``benchmarks/qwen38_plugin/footprint.py``'s
inferred geometry) at TP4 (intermediate 128 per rank), AWQ group size 128, routing assumed uniform:
a batch of T tokens touches E (1 - (1 - k/E)^T) experts. With ``$OUT`` set the tables are written
to ``$OUT/bench_awq.txt``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import V100_BW, V100_FP16, ceilings, median_ms

# Flash-Next (inferred, benchmarks/qwen38_plugin/footprint.py): one MoE layer.
HIDDEN, EXPERTS, TOP_K, MOE_INTER, LAYERS, TP, GROUP = 2560, 512, 10, 512, 40, 4, 128


def awq_bytes(k: int, n: int, group: int = GROUP) -> float:
    """Packed 4-bit weights + fp16 scales + packed zeros of a [k, n] AWQ matrix."""
    return k * n / 2 + (k // group) * n * 2 + (k // group) * n / 2


def moe_floor(tokens: int, tp: int = TP) -> tuple[float, float, float, str]:
    """Bytes, FLOPs, floor (s) and bound of one Flash-Next AWQ MoE layer on one rank."""
    inter = MOE_INTER // tp
    touched = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** tokens)
    per_expert = awq_bytes(HIDDEN, 2 * inter) + awq_bytes(inter, HIDDEN)
    activations = tokens * HIDDEN * 2 * 2 + tokens * TOP_K * (2 * inter + inter + HIDDEN) * 2 * 2
    nbytes = touched * per_expert + activations
    flops = 2.0 * tokens * TOP_K * (HIDDEN * 2 * inter + inter * HIDDEN)
    t_mem, t_math = nbytes / V100_BW, flops / V100_FP16
    return nbytes, flops, max(t_mem, t_math), "memory" if t_mem >= t_math else "tensor"


MOE_TOKENS = [1, 8, 64, 512, 4096]


def estimate_table() -> list[str]:
    lines = [
        "V100 roofline (900 GB/s, 125 fp16 tensor TFLOP/s): one Flash-Next AWQ MoE layer (H 2560, 512 experts, "
        f"top-{TOP_K}, I {MOE_INTER}), TP{TP} rank (I {MOE_INTER // TP}), group {GROUP}, uniform routing:",
        f"{'tokens':>7} {'experts':>8} {'need MB':>9} {'GFLOP':>8} {'floor us':>9} {'x40 layers ms':>14} {'bound':>7}",
    ]
    for t in MOE_TOKENS:
        nbytes, flops, floor, bound = moe_floor(t)
        touched = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** t)
        lines.append(
            f"{t:7d} {touched:8.1f} {nbytes / 1e6:9.2f} {flops / 1e9:8.3f} {floor * 1e6:9.1f} "
            f"{floor * LAYERS * 1e3:14.3f} {bound:>7}"
        )
    lines.append(
        "Memory-bound at every batch listed: up to 64 tokens the touched experts' 4-bit weights dominate (0.52 B "
        "per weight with scales and zeros, 3.85x less than fp16), beyond that the per-slot intermediates (T x top-k "
        "rows of 2I, I and H in fp16, written and read back). The shared expert (I 640) and the dense projections "
        "are linear layers (the decode gemv / prefill gemm rows of the measured table)."
    )
    return lines


def eager_ms(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def packed(k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random AWQ tensors directly (quantizing large matrices on the host would dominate the run)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), generator=g, device="cuda", dtype=torch.int32)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (k // GROUP, n // 8), generator=g, device="cuda", dtype=torch.int32)
    scales = (torch.rand(k // GROUP, n, generator=g, device="cuda") * 2e-3 + 1e-4).half()
    return qweight, qzeros, scales


DENSE = [(1, 2560, 6144), (8, 2560, 6144), (64, 2560, 6144), (512, 2560, 6144), (4096, 2560, 6144)]


def dense_row(m: int, k: int, n: int, copy_bw: float, fp16_rate: float) -> str:
    from sm70_backend.kernels import awq, awq_reference

    qweight, qzeros, scales = packed(k, n, m)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16) * 0.1
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    w = awq_reference.dequantize(qweight, qzeros, scales)
    t_ours = median_ms(lambda: awq.awq_linear(x, qweight, qzeros, scales, out=out))
    t_deq = median_ms(lambda: torch.matmul(x, awq_reference.dequantize(qweight, qzeros, scales)))
    t_mm = median_ms(lambda: torch.matmul(x, w))
    want = (x.float() @ w.float()).half()
    err = float((out.float() - want.float()).abs().max() / want.float().abs().max())
    need = awq_bytes(k, n) + (m * k + m * n) * 2
    flops = 2.0 * m * k * n
    floor = max(need / V100_BW, flops / V100_FP16)
    return (
        f"{f'linear {m}x{k}x{n}':26} {t_ours * 1e3:9.1f} {t_deq * 1e3:9.1f} {t_mm * 1e3:9.1f} {need / 1e6:9.2f} "
        f"{need / (t_ours * 1e-3) / copy_bw:9.3f} {flops / (t_ours * 1e-3) / fp16_rate:9.3f} {err:9.2e} "
        f"{floor * 1e6:9.1f}"
    )


def moe_row(tokens: int, copy_bw: float, fp16_rate: float) -> str:
    from sm70_backend.kernels import awq, awq_reference

    inter = MOE_INTER // TP
    w13 = awq.AwqExperts(
        *(torch.stack(t) for t in zip(*[packed(HIDDEN, 2 * inter, e) for e in range(EXPERTS)], strict=True))
    )
    w2 = awq.AwqExperts(
        *(torch.stack(t) for t in zip(*[packed(inter, HIDDEN, EXPERTS + e) for e in range(EXPERTS)], strict=True))
    )
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.float16) * 0.1
    ids = torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, device="cuda")
    out = torch.empty(tokens, HIDDEN, device="cuda", dtype=torch.float16)

    def ours() -> None:
        out.copy_(awq.awq_moe(x, w13, w2, weights, ids))

    t_ours = median_ms(ours, graph_calls=5, reps=10)
    want = awq_reference.moe_reference(x, w13.as_tuple(), w2.as_tuple(), weights, ids)
    t_ref = eager_ms(lambda: awq_reference.moe_reference(x, w13.as_tuple(), w2.as_tuple(), weights, ids), reps=3)
    err = float((out.float() - want.float()).abs().max() / want.float().abs().max())
    touched = int(torch.unique(ids).numel())
    need = touched * (awq_bytes(HIDDEN, 2 * inter) + awq_bytes(inter, HIDDEN)) + tokens * HIDDEN * 4
    flops = 2.0 * tokens * TOP_K * 3 * HIDDEN * inter
    _, _, floor, _ = moe_floor(tokens)
    return (
        f"{f'moe T={tokens} ({touched} experts)':26} {t_ours * 1e3:9.1f} {t_ref * 1e3:9.1f} {'-':>9} "
        f"{need / 1e6:9.2f} {need / (t_ours * 1e-3) / copy_bw:9.3f} {flops / (t_ours * 1e-3) / fp16_rate:9.3f} "
        f"{err:9.2e} {floor * 1e6:9.1f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--estimate-only", action="store_true", help="print the V100 roofline only (no GPU)")
    args = parser.parse_args()
    lines = estimate_table()
    if not args.estimate_only:
        if not torch.cuda.is_available():
            print("\n".join(lines))
            print("no CUDA device: only the V100 estimate above (run on a GPU for the measured table)")
            return 1
        copy_bw, fp16_rate = ceilings()
        lines += [
            "",
            f"{torch.cuda.get_device_name(0)}: copy {copy_bw / 1e9:.0f} GB/s (read + write), fp16 matmul "
            f"{fp16_rate / 1e12:.0f} TFLOP/s",
            f"{'case':26} {'ours us':>9} {'deq+mm us':>9} {'mm fp16':>9} {'need MB':>9} {'copy frac':>9} "
            f"{'fp16 frac':>9} {'err':>9} {'V100 us':>9}",
        ]
        for m, k, n in DENSE:
            lines.append(dense_row(m, k, n, copy_bw, fp16_rate))
            print(lines[-1], flush=True)
        for tokens in MOE_TOKENS:
            lines.append(moe_row(tokens, copy_bw, fp16_rate))
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_awq.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
