"""Timing helpers shared by the sm70_backend benchmarks (CUDA only): a kernel's median time from
CUDA-graph replays, and the copy and fp16 matmul ceilings of the GPU they run on."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

V100_BW, V100_FP16 = 900e9, 125e12  # the V100 estimates' bandwidth (bytes/s) and fp16 tensor rate (FLOP/s)


def median_ms(fn: Callable[[], None], graph_calls: int = 10, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_calls):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / graph_calls)
    return statistics.median(times)


def ceilings() -> tuple[float, float]:
    n = 1 << 29  # 1 GiB of fp16
    src = torch.randn(n, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), graph_calls=5, reps=10)
    a = torch.randn(8192, 8192, dtype=torch.float16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.float16, device="cuda")
    mm_ms = median_ms(lambda: torch.matmul(a, b), graph_calls=3, reps=10)
    return 2 * src.numel() * 2 / (copy_ms * 1e-3), 2 * 8192**3 / (mm_ms * 1e-3)
