"""The served model's fused Triton ops against their torch references on a CUDA GPU, and against
the copy ceiling measured in the same run.

    python benchmarks/qwen38_plugin/bench_fused_ops.py [--hidden 1024] [--rank 64] [--tokens 1,64,2048]

For each op (`hyper_connection.hc_norm` with the injection, `hc_mix_normed`, `norm_rope.rms_norm_rope`,
`ple_varlen.gated_conv_inputs`, `ple_varlen.conv_term_triton` for a step of one-token requests, and
for a speculative verify step, requests of 4 tokens each writing 4 state slots, the PLE mix and the
n-gram rows with their state updates) and token count, in fp16: the median time of CUDA-graph
replays (benchmarks/sm70_backend/timing.py) of the Triton path and of the torch ops it replaces,
their ratio, and the fraction of the copy ceiling: (bytes the op must read and write) / (copy
bandwidth) / (time). At decode sizes the bytes are few and the time is a launch or two, so the
fraction is small; the ratio to torch is what fusing buys there.
Prints one table; needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "sm70_backend"))

from timing import ceilings, median_ms  # noqa: E402

from qwen38_plugin.ops import hyper_connection as hc  # noqa: E402
from qwen38_plugin.ops import norm_rope, ple_varlen  # noqa: E402
from qwen38_plugin.ops.common import rotary_cos_sin  # noqa: E402

HC, HEADS, HEAD_DIM, ROTARY, KERNEL, NGRAM = 4, 8, 128, 64, 4, 3


def cases(hidden: int, rank: int, tokens: int) -> list[tuple[str, Callable[[str], object], float]]:
    """(name, run(backend), bytes moved) for one token count; ``rank``: the mixer's (medium 64, Flash-Next 320)."""
    dev, dt, width = "cuda", torch.float16, HC * hidden
    e = 2  # bytes per fp16 element

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=dev) * scale).to(dt)

    streams, block, normed = rand(tokens, width), rand(tokens, hidden), rand(tokens, width)
    injection = torch.rand(tokens, HC, device=dev).to(dt)
    norm_w, down, up, inject = rand(width, scale=0.1), rand(rank, width, scale=0.02), rand(width, rank), rand(HC, width)
    q = rand(tokens, HEADS, 2 * HEAD_DIM)[..., :HEAD_DIM]
    q_w = rand(HEAD_DIM, scale=0.1)
    cos, sin = rotary_cos_sin(torch.arange(tokens, device=dev), ROTARY, 1e6, dt)
    key, value = rand(tokens, width), rand(tokens, hidden)
    norms = [rand(width, scale=0.1) for _ in range(3)]
    span = (KERNEL - 1) * NGRAM
    conv_w, state = rand(width, KERNEL, scale=0.5), rand(tokens + 1, width, span)
    qsl = torch.arange(tokens + 1, device=dev, dtype=torch.int32)  # one token per request: a decode step
    token_req = torch.arange(tokens, device=dev, dtype=torch.int32)
    slots = torch.arange(1, tokens + 1, device=dev, dtype=torch.int32)

    def conv(backend: str) -> object:
        return ple_varlen.ple_mix_varlen(
            streams, key, value, norms[0], norms[1], norms[2], conv_w, state, token_req, qsl[:-1], slots, None,
            hc_count=HC, ngram_size=NGRAM, eps=1e-6, query_start_loc=qsl, backend=backend,
        )  # fmt: skip

    # a speculative verify step: tokens // 4 requests of 1 + 3 drafts, each writing its 4 states
    spec_reqs = max(1, tokens // 4)
    spec_tokens = 4 * spec_reqs
    spec_qsl = torch.arange(0, spec_tokens + 1, 4, device=dev, dtype=torch.int32)
    spec_req = torch.arange(spec_tokens, device=dev, dtype=torch.int32) // 4
    read = torch.arange(spec_reqs, device=dev, dtype=torch.int32) * 4
    write = torch.arange(spec_tokens, device=dev, dtype=torch.int32).view(spec_reqs, 4)
    spec_state = rand(spec_tokens, width, span)
    spec_streams, spec_key, spec_value = rand(spec_tokens, width), rand(spec_tokens, width), rand(spec_tokens, hidden)
    ids = torch.randint(0, 1000, (spec_tokens,), device=dev)
    context = torch.randint(0, 1000, (spec_tokens, NGRAM - 1), device=dev)
    multipliers = torch.randint(1, 2**40, (NGRAM,), device=dev)
    sizes = torch.full(((NGRAM - 1) * 8,), 65536, device=dev)
    offsets = sizes.cumsum(0) - sizes

    def conv_spec(backend: str) -> object:
        return ple_varlen.ple_mix_varlen(
            spec_streams, spec_key, spec_value, norms[0], norms[1], norms[2], conv_w, spec_state, spec_req,
            spec_qsl[:-1], read, None, hc_count=HC, ngram_size=NGRAM, eps=1e-6, write_indices=write,
            query_start_loc=spec_qsl, backend=backend,
        )  # fmt: skip

    def ngram_spec(backend: str) -> object:
        return ple_varlen.ngram_rows_varlen(
            ids, spec_req, spec_qsl[:-1], context, read, None, multipliers, sizes, offsets, heads_per_ngram=8,
            eos_token_id=1, write_indices=write, query_start_loc=spec_qsl, backend=backend,
        )  # fmt: skip

    return [
        ("hc_norm + inject", lambda b: hc.hc_norm(streams, norm_w, hc_count=HC, eps=1e-6, block_output=block,
                                                  injection=injection, backend=b),
         e * tokens * (3 * width + hidden) + e * width),
        ("hc_mix_normed", lambda b: hc.hc_mix_normed(normed, down, up, inject, hc_count=HC, backend=b),
         e * tokens * (width + hidden + HC) + e * (2 * rank + HC) * width),
        ("rms_norm_rope (q)", lambda b: norm_rope.rms_norm_rope(q, q_w, cos, sin, 1e-6, backend=b),
         e * tokens * (2 * HEADS * HEAD_DIM + 2 * ROTARY)),
        ("ple gate + conv input", lambda b: ple_varlen.gated_conv_inputs(
            streams, key, value, norms[0], norms[1], norms[2], hc_count=HC, eps=1e-6, conv_dtype=dt, backend=b),
         e * tokens * (4 * width + hidden) + 3 * e * width),
        ("ple mix (gate, conv, states)", conv, e * tokens * (4 * width + hidden + 2 * width * span)),
        ("ple mix, verify rows (4 states each)", conv_spec,
         e * spec_tokens * (4 * width + hidden) + e * spec_reqs * 5 * width * span),
        ("ple n-gram rows, verify rows", ngram_spec, 8 * spec_tokens * (1 + (NGRAM - 1) * 8 + NGRAM - 1)),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=64, help="the hyper-connection mixer's rank")
    parser.add_argument("--tokens", default="1,64,2048")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused_ops.py needs a CUDA GPU")
    bandwidth, _ = ceilings()
    print(f"{torch.cuda.get_device_name()}, hidden {args.hidden}, hc {HC}, rank {args.rank}, fp16, "
          f"copy {bandwidth / 1e9:.0f} GB/s")  # fmt: skip
    print("| op | tokens | triton us | torch us | torch / triton | of copy ceiling |")
    print("|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, run, nbytes in cases(args.hidden, args.rank, tokens):
            fast = median_ms(lambda run=run: run("triton")) * 1e3
            ref = median_ms(lambda run=run: run("torch")) * 1e3
            print(f"| {name} | {tokens} | {fast:.1f} | {ref:.1f} | {ref / fast:.1f}x | "
                  f"{nbytes / bandwidth / (fast * 1e-6):.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
