"""Where a decode step of the portable Qwen4Exp goes inside vLLM on a GPU: wall time per step
against the GPU's busy time per step, and the top kernels and host calls, from torch's profiler.

    python benchmarks/qwen38_plugin/profile_gpu.py OUT_DIR [--config medium | --model DIR] [--batches 1,64]
        [--enforce-eager | --compiled] [--speculative mtp|dflash|none [--drafts 3]] [--work DIR]

Modes: vLLM's default for this architecture (breakable CUDA graphs, no torch.compile),
``--compiled`` (torch.compile with piecewise and full CUDA graphs: ``VLLM_USE_BREAKABLE_CUDAGRAPH=0``)
or ``--enforce-eager``. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the profiler sees the
model runner. For each batch size: a warm-up, then ``--steps`` decode steps of ``B`` requests
under the profiler. Printed (and written to OUT_DIR/profile-b<B>.txt): wall ms per decode step,
GPU kernel ms per step (the sum of kernel times: if it is far below the wall time, the step is
bound by the host), CUDA graph launches per step, and the top entries by self CUDA and self CPU
time. ``--model DIR`` profiles a checkpoint built elsewhere instead of ``--config``'s, e.g. bench_tp.py's
Flash-Next widths (part r of benchmarks/h200_session.sh builds it under /tmp/qwen38_bench_tp): there a
decode step at batch 1 took 4 ms against a 13.5 % roofline fraction (2026-12-04), and what fills it has not
been profiled.

``--speculative``: the same with speculative decoding (issue 12 item 6: a speculative step cost
2.6x (DFlash) and 3.3x (MTP) a plain one at batch 1 on the H200): ``mtp`` (the checkpoint's random
MTP head), ``dflash`` (a random one-layer drafter of bench_mtp_trained.py's geometry) or ``none``
(no speculation, with the same engine settings: prefix caching off, as the portable model wants
beside DFlash). Random drafts are all rejected, so every step emits one token and its wall time is
the whole cost of a speculative step: the target verifying ``1 + --drafts`` tokens a request, the
rejection sampler and the drafter's passes. Without ``--speculative`` the engine keeps vLLM's
defaults (prefix caching on).

``--draft-vocab N`` with ``--speculative dflash`` (random drafter): the drafter has its own lm_head
over N tokens (stock's ``draft_vocab_size`` / ``d2t``), so the same A/B gives what a reduced draft
vocabulary saves a step (its full-vocabulary GEMV was 0.18 ms of 2.97, 2026-12-06 part l).

``--trained OUT/bench_mtp_trained.json``: bench_mtp_trained.py's trained setting for ``--speculative``
instead (``none``: its pretrained target; ``mtp``: the target with the trained head; ``dflash``: the
pretrained target and the trained drafter; prompts from its held-out corpus windows), so drafts are
accepted and a step emits several tokens. The verify steps are counted from vLLM's spec-decode
counters, and the wall and GPU times are given per verify step (2026-12-04 on the H200, unprofiled,
concurrency 1: a DFlash step with accepted drafts 5.35 ms, MTP's 4.29, a plain step 3.16; with every
draft rejected DFlash's had taken about a plain step's, but such ratios between processes moved by
up to 2x from one machine to the next). Part l of benchmarks/h200_session.sh runs it after part k.
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

from bench_gpu import CAPTURE_SIZES_HELP, _prompts, build_checkpoint, capture_sizes  # noqa: E402


def speculative_engine(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The target checkpoint and vLLM's extra arguments for ``--speculative``."""
    import json
    from types import SimpleNamespace

    from bench_mtp_trained import build_checkpoint as build_mtp_checkpoint
    from bench_mtp_trained import dflash_config_for

    work = args.work or args.out
    # the medium geometry with an MTP head, or a trained one
    model = args.target or args.model or build_mtp_checkpoint(work, args.config, args.dtype)
    extra: dict[str, Any] = {"enable_prefix_caching": False}
    if args.speculative == "mtp":
        extra["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.drafts}
    elif args.speculative == "dflash" and args.drafter:
        extra["speculative_config"] = {"method": "dflash", "model": str(args.drafter),
                                       "num_speculative_tokens": args.drafts}  # fmt: skip
    elif args.speculative == "dflash":
        from safetensors.torch import save_file

        from dflash2.tiny import drafter_weights

        vocab = f"-v{args.draft_vocab}" if args.draft_vocab else ""
        drafter = work / f"dflash-{args.config}-{args.drafts}{vocab}"
        if not drafter.exists():
            options = SimpleNamespace(dflash_layers=1, dflash_drafts=args.drafts, dtype=args.dtype)
            config = dflash_config_for(options, model)
            weights = drafter_weights(config)
            if args.draft_vocab:
                # its own random lm_head over the first N token ids (d2t all 0): the step's cost, not its drafts
                import torch

                config["draft_vocab_size"] = args.draft_vocab
                weights["lm_head.weight"] = torch.randn(args.draft_vocab, config["hidden_size"]).to(torch.bfloat16)
                weights["d2t"] = torch.zeros(args.draft_vocab, dtype=torch.long)
            drafter.mkdir(parents=True)
            save_file(weights, str(drafter / "model.safetensors"))
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
    parser.add_argument("--drafts", type=int, help="draft tokens a step (default 3; with --trained and dflash, the "
                        "count its drafter was trained for)")  # fmt: skip
    parser.add_argument("--draft-vocab", type=int, default=0, help="--speculative dflash, random drafter: its own "
                        "lm_head over this many tokens (stock's draft_vocab_size, d2t; 0: the target's)")  # fmt: skip
    parser.add_argument("--work", type=Path)
    parser.add_argument("--model", type=Path, help="a checkpoint directory to profile instead of --config's")
    parser.add_argument("--capture-sizes", default="measured", choices=("measured", "vllm"), help=CAPTURE_SIZES_HELP)
    parser.add_argument("--trained", type=Path, help="bench_mtp_trained.py's report: serve its trained setting")
    args = parser.parse_args()
    args.target = args.drafter = args.corpus = None
    if args.trained and args.model:
        parser.error("--model and --trained both name the target: give one")
    if args.model and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; give a checkpoint directory")
    if args.draft_vocab and (args.speculative != "dflash" or args.trained):
        # The reduced head belongs to the random drafter only: a trained drafter carries its own
        # draft_vocab_size, and MTP or no speculation has no drafter head to shrink.
        parser.error(f"--draft-vocab {args.draft_vocab}: only with --speculative dflash and no --trained; "
                     "drop it, or profile the random DFlash drafter")  # fmt: skip
    if args.trained:
        trained_setting(parser, args)
    if args.drafts is None:
        args.drafts = 3
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
    elif args.model:
        model = args.model
    else:
        model = build_checkpoint(args.work or args.out, args.config, args.dtype, stock_gate=False)
    batches = [int(b) for b in args.batches.split(",")]
    label = args.speculative or "default"
    if args.speculative in ("mtp", "dflash"):
        label += str(args.drafts)
    if args.draft_vocab:
        label += f"-v{args.draft_vocab}"
    drafts = args.drafts if args.speculative in ("mtp", "dflash") else 0
    sizes = None if args.enforce_eager else capture_sizes(args.capture_sizes, batches, 1 + drafts, args.prompt_len)
    if sizes is not None:
        extra["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    llm = LLM(
        model=str(model), dtype=args.dtype, max_model_len=args.prompt_len + args.steps + 16, seed=0,
        max_num_seqs=max(batches), gpu_memory_utilization=0.5, enforce_eager=args.enforce_eager,
        disable_log_stats=not args.speculative, **extra,
    )  # fmt: skip
    for batch in batches:
        if args.corpus:
            from bench_mtp_trained import random_prompts

            token_ids = random_prompts(batch, 1000 + batch, str(args.corpus))
        else:
            token_ids = _prompts(batch, args.prompt_len, seed=batch)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in token_ids]

        def run(max_tokens: int, inputs: list[TokensPrompt] = inputs) -> float:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            sync()
            start = time.perf_counter()
            llm.generate(inputs, params, use_tqdm=False)
            sync()
            return time.perf_counter() - start

        run(4)
        prefill = min(run(1) for _ in range(3))
        before = verify_steps(llm)
        total = min(run(args.steps + 1) for _ in range(3))
        # decode steps of the timed runs: one per token without speculation, else vLLM's verify steps
        steps = (verify_steps(llm) - before) / 3 / batch if args.speculative not in (None, "none") else args.steps
        step_ms = 1e3 * (total - prefill) / steps
        before = verify_steps(llm)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(args.steps + 1)
        if args.speculative not in (None, "none"):
            steps = (verify_steps(llm) - before) / batch
        events = prof.key_averages()
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
        launches = sum(e.count for e in events if e.key == "cudaGraphLaunch")
        lines = [
            f"{label} batch {batch}: wall {step_ms:.3f} ms per decode step (prefill {1e3 * prefill:.1f} ms); "
            f"GPU kernels {kernel_us / 1e3 / (steps + 1):.3f} ms per step (prefill included); "
            f"cudaGraphLaunch {launches / (steps + 1):.1f} per step; "
            f"{args.steps / steps:.2f} tokens per step ({steps:.1f} steps for {args.steps} tokens a request)",
            events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90),
            events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90),
        ]
        text = "\n".join(lines)
        (args.out / f"profile{'-' + label if args.speculative else ''}-b{batch}.txt").write_text(text)
        print(lines[0], flush=True)


def trained_setting(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.target`` / ``drafter`` / ``corpus`` / ``prompt_len`` from bench_mtp_trained.py's report."""
    import json

    from bench_mtp_trained import PROMPT_LEN

    if not args.speculative:
        parser.error("--trained: give --speculative none|mtp|dflash (the trained setting to serve)")
    try:
        report = json.loads(args.trained.read_text())
        paths = report["paths"]
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"--trained {args.trained}: no bench_mtp_trained.py report with its 'paths' ({exc!r}); "
                     "run bench_mtp_trained.py past its dflash-train stage first")  # fmt: skip
    wanted = {"none": ["plain"], "mtp": ["mtp"], "dflash": ["plain", "dflash"]}[args.speculative] + ["corpus"]
    if missing := [k for k in wanted if not paths.get(k)]:
        parser.error(f"--trained {args.trained}: the report has no {missing} for --speculative {args.speculative} "
                     "(run bench_mtp_trained.py with that method and --pretrain-steps)")  # fmt: skip
    args.target = Path(paths["mtp" if args.speculative == "mtp" else "plain"])
    args.drafter = Path(paths["dflash"]) if args.speculative == "dflash" else None
    args.corpus = Path(paths["corpus"])
    args.prompt_len = PROMPT_LEN  # the corpus windows' length
    trained_drafts = report.get("dflash_train", {}).get("drafts")
    if args.speculative == "dflash" and trained_drafts:
        # a DFlash drafter drafts the block it was trained for; serving it with another count is another setting
        if args.drafts not in (None, trained_drafts):
            parser.error(f"--drafts {args.drafts}: the trained drafter drafts {trained_drafts} tokens a step; "
                         "leave --drafts out or give that")  # fmt: skip
        args.drafts = trained_drafts


def verify_steps(llm: Any) -> float:
    """vLLM's count of verify steps summed over requests (spec-decode drafts), 0 without speculation
    (an engine without stats has no counters to read: vLLM asserts on them)."""
    from bench_mtp_trained import spec_counters

    if not llm.llm_engine.log_stats:
        return 0.0
    return float(spec_counters(llm).get("spec_decode_num_drafts", 0))


if __name__ == "__main__":
    main()
