"""Where a decode step of the portable Qwen4Exp goes inside vLLM on a GPU: wall time per step
against the GPU's busy time per step, and the top kernels and host calls, from torch's profiler.

    python benchmarks/qwen38_plugin/profile_gpu.py OUT_DIR [--config medium] [--batches 1,64]
        [--enforce-eager | --compiled] [--speculative mtp|dflash|none [--drafts 3]] [--work DIR]

Modes: vLLM's default for this architecture (breakable CUDA graphs, no torch.compile),
``--compiled`` (torch.compile with piecewise and full CUDA graphs: ``VLLM_USE_BREAKABLE_CUDAGRAPH=0``)
or ``--enforce-eager``. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the profiler sees the
model runner. For each batch size: a warm-up, then ``--steps`` decode steps of ``B`` requests
under the profiler. Printed (and written to OUT_DIR/profile-b<B>.txt): wall ms per decode step,
GPU kernel ms per step (the sum of kernel times: if it is far below the wall time, the step is
bound by the host), CUDA graph launches per step, and the top entries by self CUDA and self CPU
time.

``--speculative``: the same with speculative decoding (issue 12 item 6: a speculative step cost
2.6x (DFlash) and 3.3x (MTP) a plain one at batch 1 on the H200): ``mtp`` (the checkpoint's random
MTP head), ``dflash`` (a random one-layer drafter of bench_mtp_trained.py's geometry) or ``none``
(no speculation, with the same engine settings: prefix caching off, as the portable model wants
beside DFlash). Random drafts are all rejected, so every step emits one token and its wall time is
the whole cost of a speculative step: the target verifying ``1 + --drafts`` tokens a request, the
rejection sampler and the drafter's passes. Without ``--speculative`` the engine keeps vLLM's
defaults (prefix caching on).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "qwen38_plugin"))

from bench_gpu import _prompts, build_checkpoint  # noqa: E402


def speculative_engine(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The target checkpoint and vLLM's extra arguments for ``--speculative``."""
    import json
    from types import SimpleNamespace

    from bench_mtp_trained import build_checkpoint as build_mtp_checkpoint
    from bench_mtp_trained import dflash_config_for

    work = args.work or args.out
    model = build_mtp_checkpoint(work, args.config, args.dtype)  # the medium geometry with an MTP head
    extra: dict[str, Any] = {"enable_prefix_caching": False}
    if args.speculative == "mtp":
        extra["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.drafts}
    elif args.speculative == "dflash":
        from safetensors.torch import save_file

        from dflash2.tiny import drafter_weights

        drafter = work / f"dflash-{args.config}-{args.drafts}"
        if not drafter.exists():
            options = SimpleNamespace(dflash_layers=1, dflash_drafts=args.drafts, dtype=args.dtype)
            config = dflash_config_for(options, model)
            drafter.mkdir(parents=True)
            save_file(drafter_weights(config), str(drafter / "model.safetensors"))
            (drafter / "config.json").write_text(json.dumps(config, indent=2))
        extra["speculative_config"] = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": args.drafts}
    return model, extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", default="medium")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--enforce-eager", action="store_true")
    mode.add_argument("--compiled", action="store_true", help="torch.compile instead of breakable CUDA graphs")
    parser.add_argument("--speculative", choices=["mtp", "dflash", "none"])
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--work", type=Path)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.compiled:
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    args.out.mkdir(parents=True, exist_ok=True)
    extra: dict[str, Any] = {}
    if args.speculative:
        model, extra = speculative_engine(args)
    else:
        model = build_checkpoint(args.work or args.out, args.config, args.dtype, stock_gate=False)
    batches = [int(b) for b in args.batches.split(",")]
    label = args.speculative or "default"
    if args.speculative in ("mtp", "dflash"):
        label += str(args.drafts)
    llm = LLM(
        model=str(model), dtype=args.dtype, max_model_len=args.prompt_len + args.steps + 16, seed=0,
        max_num_seqs=max(batches), gpu_memory_utilization=0.5, enforce_eager=args.enforce_eager, **extra,
    )  # fmt: skip
    for batch in batches:
        inputs = [TokensPrompt(prompt_token_ids=p) for p in _prompts(batch, args.prompt_len, seed=batch)]

        def run(max_tokens: int, inputs: list[TokensPrompt] = inputs) -> float:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            sync()
            start = time.perf_counter()
            llm.generate(inputs, params, use_tqdm=False)
            sync()
            return time.perf_counter() - start

        run(4)
        prefill = min(run(1) for _ in range(3))
        total = min(run(args.steps + 1) for _ in range(3))
        step_ms = 1e3 * (total - prefill) / args.steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(args.steps + 1)
        events = prof.key_averages()
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
        launches = sum(e.count for e in events if e.key == "cudaGraphLaunch")
        lines = [
            f"{label} batch {batch}: wall {step_ms:.3f} ms per decode step (prefill {1e3 * prefill:.1f} ms); "
            f"GPU kernels {kernel_us / 1e3 / (args.steps + 1):.3f} ms per step (prefill included); "
            f"cudaGraphLaunch {launches / (args.steps + 1):.1f} per step",
            events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90),
            events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90),
        ]
        text = "\n".join(lines)
        (args.out / f"profile{'-' + label if args.speculative else ''}-b{batch}.txt").write_text(text)
        print(lines[0], flush=True)


if __name__ == "__main__":
    main()
