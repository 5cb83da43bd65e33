"""Gated DeltaNet's delta rule on CUDA: fla-core's kernels vs the plain-torch reference, and the roofline.

    python benchmarks/qwen38_plugin/bench_gdn_cuda.py        # on a CUDA machine with fla-core

Flash-Next's GDN geometry per layer at TP=1 (16 key heads, 48 value heads, head size 128), for
decode steps (1 token per sequence, fused recurrent kernel) and a prefill (chunked kernel), in
bf16 and fp16. Both sides get the same inputs; the plain-torch side is `ops.gdn`'s reference
(repeat of q/k heads included). Times are medians of `triton.testing.do_bench` (device events).

The roofline floor of a case is max(bytes / bandwidth, flops / matmul rate), with the two
ceilings measured in the same run (a 1 GiB device-to-device copy counting bytes read and
written; a bf16 8192^3 matmul). Bytes: q, k, v, o once, beta and g once, the fp32 state read and
written. Flops (prefill, chunk C=64, per token and value head): 6 D^2 (state read into the
output, the correction w S, the state update) + 8 C D (the in-chunk products); decode: 6 D^2.
`roofline` is floor / measured time (1.0 = at the floor). Prints one table.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src" / "qwen38_plugin"))

from qwen38_plugin.ops import gdn, gdn_cuda

HK, HV, D, CHUNK = 16, 48, 128, 64


def bench(fn: Callable[[], Any]) -> float:
    """Median milliseconds of fn (device events, after warm-up)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=300, return_mode="median"))


def ceilings() -> tuple[float, float]:
    """(bytes/s of a device-to-device copy counting read + write, bf16 matmul flop/s), measured here."""
    src = torch.empty(2**29, dtype=torch.float16, device="cuda").normal_()  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = bench(lambda: a @ b)
    return 2 * src.numel() * 2 / (copy_ms * 1e-3), 2 * 8192**3 / (mm_ms * 1e-3)


def case(batch: int, seq_len: int, dtype: torch.dtype) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(batch * 1000 + seq_len)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    q, k, v = r(batch, seq_len, HK, D), r(batch, seq_len, HK, D), r(batch, seq_len, HV, D)
    g = -torch.rand(batch, seq_len, HV, generator=gen, device="cuda") * 0.5
    beta = torch.rand(batch, seq_len, HV, generator=gen, device="cuda").to(dtype)
    state = torch.randn(batch, HV, D, D, generator=gen, device="cuda") * 0.1
    prefill = seq_len > 1

    def fla() -> Any:
        return gdn_cuda.gated_delta_rule_fla(q, k, v, g, beta, state, chunked=prefill)

    def reference() -> Any:
        qr, kr = q.repeat_interleave(HV // HK, dim=2), k.repeat_interleave(HV // HK, dim=2)
        if prefill:
            return gdn.gated_delta_rule_chunked(qr, kr, v, g, beta, state, CHUNK)
        return gdn.gated_delta_rule_recurrent(qr, kr, v, g, beta, state)

    tokens = batch * seq_len
    elem = torch.finfo(dtype).bits // 8
    moved = tokens * (2 * HK * D + 2 * HV * D + HV) * elem + tokens * HV * 4 + 2 * batch * HV * D * D * 4
    flops = tokens * HV * (6 * D * D + (8 * CHUNK * D if prefill else 0))
    return {"fla_ms": bench(fla), "torch_ms": bench(reference), "bytes": moved, "flops": flops}


def main() -> None:
    if not torch.cuda.is_available():
        print("bench_gdn_cuda: no CUDA device here; run it on a CUDA machine (nothing measured)")
        return
    if gdn_cuda.fla_kernels() is None:
        print(f"bench_gdn_cuda: fla-core is not installed; {gdn_cuda.INSTALL_HINT} (nothing measured)")
        return
    bandwidth, matmul = ceilings()
    print(f"device: {torch.cuda.get_device_name()}; measured ceilings: copy {bandwidth / 1e12:.2f} TB/s "
          f"(read + write), bf16 matmul {matmul / 1e12:.0f} TFLOP/s")  # fmt: skip
    print(f"geometry: Hk={HK} Hv={HV} D={D} (Flash-Next GDN layer, TP=1)")
    header = f"{'case':<24}{'dtype':<10}{'fla ms':>10}{'torch ms':>10}{'speedup':>9}{'floor ms':>10}{'roofline':>9}"
    print(header)
    for label, batch, seq_len in (("decode B=1", 1, 1), ("decode B=64", 64, 1), ("decode B=256", 256, 1),
                                  ("prefill T=4096", 1, 4096), ("prefill 4x T=1024", 4, 1024)):  # fmt: skip
        for dtype in (torch.bfloat16, torch.float16):
            m = case(batch, seq_len, dtype)
            floor = max(m["bytes"] / bandwidth, m["flops"] / matmul) * 1e3
            print(f"{label:<24}{str(dtype).removeprefix('torch.'):<10}{m['fla_ms']:>10.4f}{m['torch_ms']:>10.3f}"
                  f"{m['torch_ms'] / m['fla_ms']:>8.1f}x{floor:>10.4f}{floor / m['fla_ms']:>9.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
