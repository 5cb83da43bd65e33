"""CSF scale decode throughput against a plain copy of the same bytes, measured in one run.

    python benchmarks/csf_loader/bench_decode.py [--device cuda|cpu] [--experts N] [--json FILE]

For each codec it builds one layer of expert scale planes from NVFP4 / MXFP4 scales of
Gaussian weights (per-row spread varies), encodes them, then times
  * decode: cuda = the stacked Triton kernels (fixed stream + exceptions), cpu = the
    vectorised torch reference, each writing the native [experts, rows, cols] bytes;
  * copy: ``dst.copy_(src)`` of a buffer the size of the decoded scales.
It reports decoded-scale GB/s (decoded bytes / time), the copy's GB/s (bytes copied /
time) and their ratio; both timings come from this run on this device. Every decode is
checked bit for bit against the source bytes before timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from csf_loader.codec import MXFP4_CSF, NVFP4_CSF, CsfCodec, decode, encode

# (codec, rows, cols): NVFP4 w13 of hidden 4096 / intermediate 1024 per expert, and the
# published DeepSeek-V4.1-Flash MXFP4 w1/w3 geometry (R=2304, C=160).
GEOMETRIES: list[tuple[CsfCodec, int, int]] = [(NVFP4_CSF, 2048, 256), (MXFP4_CSF, 2304, 160)]


def source_scales(codec: CsfCodec, experts: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Block scales of Gaussian weights quantized the standard way (uint8 bytes)."""
    g = torch.Generator().manual_seed(seed)
    group = 16 if codec is NVFP4_CSF else 32
    row_std = torch.exp(torch.randn(experts, rows, 1, 1, generator=g) * 0.5) * 0.02
    # One expert at a time keeps the Gaussian draw small in host memory.
    amax = torch.stack(
        [(torch.randn(rows, cols, group, generator=g) * row_std[e]).abs().amax(-1) for e in range(experts)]
    )
    if codec is NVFP4_CSF:
        # ModelOpt: per-tensor global scale maps the largest block scale to E4M3 max.
        global_scale = 448.0 * 6.0 / amax.amax()
        return (amax / 6.0 * global_scale).clamp(max=448).to(torch.float8_e4m3fn).view(torch.uint8)
    # OCP MX: shared exponent floor(log2(amax)) - 2 (E2M1 max exponent), biased by 127.
    exponent = torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - 2
    return (exponent + 127).clamp(0, 254).to(torch.uint8)


def timed(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def timed_cuda(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def bench_codec(codec: CsfCodec, rows: int, cols: int, experts: int, device: str) -> dict[str, object]:
    scales = source_scales(codec, experts, rows, cols, seed=1)
    planes = [encode(scales[e], codec) for e in range(experts)]
    exceptions = sum(p.exceptions.numel() for p in planes)
    compressed = sum(p.fixed.numel() + 4 * p.exceptions.numel() for p in planes)
    decoded_bytes = scales.numel()
    result: dict[str, object] = {
        "codec": codec.name,
        "experts": experts,
        "rows": rows,
        "cols": cols,
        "decoded_bytes": decoded_bytes,
        "compressed_bytes": compressed,
        "compression_ratio": decoded_bytes / compressed,
        "exception_rate": exceptions / decoded_bytes,
    }
    if device == "cuda":
        from csf_loader.triton_decode import decode_triton_stacked

        fixed = torch.cat([p.fixed.reshape(-1) for p in planes]).cuda()
        words = torch.cat([p.exceptions for p in planes]).cuda()
        counts = torch.tensor([0] + [p.exceptions.numel() for p in planes], dtype=torch.int64)
        starts = counts.cumsum(0).cuda()
        max_count = int(counts.max().item())
        out = torch.empty(experts, rows, cols, dtype=torch.uint8, device="cuda")
        copy_src = torch.empty(decoded_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
        copy_dst = torch.empty_like(copy_src)
        copy_s = timed_cuda(lambda: copy_dst.copy_(copy_src), 50)
        configs = []
        sweep = [("words", br, bc, w) for br, bc, w in [(16, 256, 4), (32, 256, 4), (64, 256, 4), (64, 128, 4)]]
        sweep += [("words", 128, 256, 8), ("words", 256, 256, 8), ("bytes", 32, 256, 4), ("bytes", 128, 256, 8)]
        for variant, block_r, block_c, warps in sweep:
            out.fill_(0xA5)  # poison: every byte must be written

            def run(v: str = variant, br: int = block_r, bc: int = block_c, w: int = warps) -> None:
                decode_triton_stacked(
                    fixed, words, starts, codec, experts, rows, cols, out, br, bc, w, max_count, variant=v
                )

            run()
            torch.cuda.synchronize()
            if not torch.equal(out.cpu(), scales):
                raise SystemExit(f"bit mismatch: {codec.name} {variant} {block_r}x{block_c}")
            seconds = timed_cuda(run, 50)
            configs.append(
                {
                    "variant": variant,
                    "block_r": block_r,
                    "block_c": block_c,
                    "num_warps": warps,
                    "seconds": seconds,
                    "decode_GBps": decoded_bytes / seconds / 1e9,
                }
            )
        best = max(configs, key=lambda c: float(c["decode_GBps"]))  # type: ignore[arg-type]
        # Memory traffic, counted like the copy ceiling (bytes read + bytes written):
        # fixed stream + exception words read, decoded bytes + exception bytes written.
        traffic = compressed + decoded_bytes + exceptions
        best_s = float(best["seconds"])  # type: ignore[arg-type]
        copy_traffic_gbps = 2 * decoded_bytes / copy_s / 1e9
        result.update(
            configs=configs,
            best=best,
            copy_GBps=decoded_bytes / copy_s / 1e9,
            copy_traffic_GBps=copy_traffic_gbps,
            decode_GBps=best["decode_GBps"],
            decode_traffic_GBps=traffic / best_s / 1e9,
            ratio_to_copy=copy_s / best_s,
            traffic_ratio_to_copy=traffic / best_s / 1e9 / copy_traffic_gbps,
            traffic_ratio_to_4246=traffic / best_s / 1e9 / 4246.0,
        )
    else:
        out_list: list[torch.Tensor] = []

        def run_cpu() -> None:
            out_list.clear()
            out_list.extend(decode(p, codec, rows, cols) for p in planes)

        run_cpu()
        if not torch.equal(torch.stack(out_list), scales):
            raise SystemExit(f"bit mismatch: {codec.name} cpu")
        seconds = timed(run_cpu, lambda: None, 5)
        src = scales.clone()
        dst = torch.empty_like(src)
        copy_s = timed(lambda: dst.copy_(src), lambda: None, 20)
        result.update(
            decode_GBps=decoded_bytes / seconds / 1e9,
            copy_GBps=decoded_bytes / copy_s / 1e9,
            ratio_to_copy=copy_s / seconds,
            threads=torch.get_num_threads(),
        )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--experts", type=int, default=None, help="planes per layer (cuda 256, cpu 16)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    experts = args.experts or (256 if args.device == "cuda" else 16)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu x{torch.get_num_threads()}"
    results = [bench_codec(codec, rows, cols, experts, args.device) for codec, rows, cols in GEOMETRIES]
    for r in results:
        print(
            f"{device_name}  {r['codec']}: {r['experts']}x[{r['rows']}, {r['cols']}] "
            f"ratio {float(r['compression_ratio']):.3f}x  exceptions {100 * float(r['exception_rate']):.2f} %  "  # type: ignore[arg-type]
            f"decode {float(r['decode_GBps']):.1f} GB/s  copy {float(r['copy_GBps']):.1f} GB/s  "  # type: ignore[arg-type]
            f"decode/copy {float(r['ratio_to_copy']):.2f}"  # type: ignore[arg-type]
            + (
                f"  traffic {float(r['decode_traffic_GBps']):.0f} GB/s vs copy traffic "  # type: ignore[arg-type]
                f"{float(r['copy_traffic_GBps']):.0f} GB/s = {float(r['traffic_ratio_to_copy']):.2f}"  # type: ignore[arg-type]
                f" (vs 4246: {float(r['traffic_ratio_to_4246']):.2f})"  # type: ignore[arg-type]
                f" best {r['best']}"
                if "traffic_ratio_to_copy" in r
                else ""
            )
        )
    if args.json:
        args.json.write_text(json.dumps({"device": device_name, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
