"""Decode/prefill throughput and peak memory: our model inside stock vLLM (CPU) vs transformers.

    .venv/bin/python benchmarks/qwen38_plugin/bench_cpu.py [--config tiny|medium|both] [--concurrency 8]

For each config it builds a random checkpoint (cached under .cache/bench/), then measures on
this machine, one after the other:
- transformers `Qwen4ExpForCausalLM.generate` (greedy), all requests as one batch (the
  prompts have equal lengths, so no padding is involved);
- stock vLLM with the plugin (`vllm.LLM`, the same prompts, all requests submitted at once),
  in each engine layout of ``--engine``: ``multiprocess`` is vLLM's default and what `vllm serve`
  runs (engine core and CPU worker in processes of their own, the worker's threads bound to
  cores), ``inprocess`` sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (scheduler and model in the
  calling process; vLLM binds no threads there, so ``--threads N`` sets torch's thread count).
  The two differ by what vLLM's engine adds around the model (scheduling, inter-process
  messages); results/bench_cpu.txt records both.
Prefill tokens/s uses max_tokens=1; decode tokens/s uses (generated tokens) / (total - prefill
time); each side runs ``--repeats`` times (default 3) after a warm-up and the medians are printed.
Peak memory is the sum of the peak RSS (VmHWM) of the measuring process and its live
descendants (vLLM's engine core and worker processes included).
Prints the ratios ours / transformers.

Same conditions for both sides: both children hold every engine core of tests/engines.py (no
other vLLM engine of this repository's tests runs meanwhile), in the same dtype (``--dtype``), and with
``--threads N`` on the same N cores: transformers with ``torch.set_num_threads(N)``, vLLM's CPU
worker with ``VLLM_CPU_OMP_THREADS_BIND=0-(N-1)``. ``--threads auto`` keeps each side's own
default instead: torch uses every core, while vLLM's CPU worker binds its threads to all cores
but one, which it reserves for the engine's other processes (1 of 2 cores on a 2-core machine).
The compute threads each side used are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "medium": {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3
        + ["indexed_attention"]
        + ["linear_attention"] * 3
        + ["indexed_attention"],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 512,
        "hc_lowrank": 64,
        "ple_layer_ids": [1, 2],
        "ple_embed_dim": 256,
        "indexer_head_dim": 128,
        "indexer_budget": 64,
        "indexer_compress_ratio": 8,
    },
}


# vLLM engine layouts (environment of the vLLM child).
ENGINES: dict[str, dict[str, str]] = {
    "multiprocess": {},
    "inprocess": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
}


def checkpoint(name: str) -> Path:
    sys.path.insert(0, str(ROOT / "src" / "qwen38_plugin"))
    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint

    out = ROOT / ".cache" / "bench" / f"qwen4_exp_text-{name}"
    if not out.exists():
        build_tiny_checkpoint(out, "qwen4_exp_text", overrides=CONFIGS[name], dtype="float32")
    return out


def prompts(n: int, length: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 240_000, (length,), generator=gen).tolist() for _ in range(n)]


def measure_transformers(
    model: Path, ps: list[list[int]], new_tokens: int, dtype: str, threads: str, repeats: int
) -> dict[str, float]:
    import torch
    from transformers import Qwen4ExpForCausalLM

    if threads != "auto":
        torch.set_num_threads(int(threads))
    hf = Qwen4ExpForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    # All prompts have the same length, so they run as one batch without padding.
    ids = torch.tensor(ps)

    def generate(max_new_tokens: int) -> None:
        hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)

    with torch.no_grad():
        hf.generate(ids[:1, :8], max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)  # warm-up
        result = _median_rates(ps, new_tokens, repeats, generate)
    return {**result, "threads": torch.get_num_threads()}


def measure_vllm(
    model: Path, ps: list[list[int]], new_tokens: int, dtype: str, threads: str, repeats: int
) -> dict[str, float]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    if in_process and threads != "auto":
        # vLLM binds its worker's threads only when it runs the worker in a process of its own.
        torch.set_num_threads(int(threads))
    llm = LLM(model=str(model), dtype=dtype, max_model_len=1024, seed=0, max_num_seqs=len(ps))
    inputs = [TokensPrompt(prompt_token_ids=p) for p in ps]

    def generate(max_new_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(inputs, params, use_tqdm=False)

    llm.generate(inputs[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    result = _median_rates(ps, new_tokens, repeats, generate)
    if in_process:
        result["threads"] = torch.get_num_threads()  # the worker runs in this process
    return result


def _median_rates(
    ps: list[list[int]], new_tokens: int, repeats: int, generate: Callable[[int], None]
) -> dict[str, float]:
    """Median over ``repeats`` runs of prefill (max_tokens=1) then the full generation."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate(1)
        t1 = time.perf_counter()
        generate(new_tokens)
        t2 = time.perf_counter()
        runs.append(_rates(ps, new_tokens, t1 - t0, t2 - t1))
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def _rates(ps: list[list[int]], new_tokens: int, prefill: float, total: float) -> dict[str, float]:
    prompt_tokens = sum(len(p) for p in ps)
    decode_time = max(total - prefill, 1e-9)
    return {
        "prefill_tok_s": prompt_tokens / prefill,
        "decode_tok_s": len(ps) * (new_tokens - 1) / decode_time,
        "peak_rss_mib": tree_peak_rss_mib(),
    }


def tree_peak_rss_mib() -> float:
    """Sum of the peak RSS (VmHWM) of this process and its live descendants (vLLM's engine core
    and worker run as child processes; ru_maxrss would count only children already reaped)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        pid = frontier.pop()
        children = [c for c, parent in parents.items() if parent == pid and c not in tree]
        tree.update(children)
        frontier.extend(children)
    total_kib = 0
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total_kib += int(line.split()[1])
        except OSError:
            continue
    return total_kib / 1024


def child(args: argparse.Namespace) -> None:
    model = checkpoint(args.config)
    ps = prompts(args.concurrency, args.prompt_len)
    measure = measure_vllm if args.child == "vllm" else measure_transformers
    result = measure(model, ps, args.new_tokens, args.dtype, args.threads, args.repeats)
    print("RESULT " + json.dumps(result), flush=True)


def run_child(
    kind: str, name: str, args: argparse.Namespace, extra_env: dict[str, str] | None = None
) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", kind, "--config", name, "--concurrency", str(args.concurrency),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--dtype", args.dtype,
           "--threads", args.threads, "--repeats", str(args.repeats)]  # fmt: skip
    # Both sides hold every engine core the repository's tests take, so neither competes with them.
    cmd = [sys.executable, str(ROOT / "tests" / "engines.py"), *cmd]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", **(extra_env or {})}
    if args.threads != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{int(args.threads) - 1}"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{kind} {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result: dict[str, float] = json.loads(lines[-1].removeprefix("RESULT "))
    if kind == "vllm" and "threads" not in result:
        # vLLM logs the cores its CPU worker's OpenMP threads are bound to: "core ids=[0, 1]".
        bound = re.findall(r"core ids=\[([0-9, ]*)\]", proc.stdout + proc.stderr)
        result["threads"] = len(bound[-1].split(",")) if bound else float("nan")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=[*CONFIGS, "both"], default="both")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", default="auto", help="compute threads of both sides, or auto (see above)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side; the medians are printed")
    parser.add_argument("--engine", choices=[*ENGINES, "both"], default="both", help="vLLM engine layout(s), see above")
    parser.add_argument("--child", choices=["vllm", "transformers"])
    args = parser.parse_args()
    if args.threads != "auto" and not (args.threads.isdigit() and 0 < int(args.threads) <= (os.cpu_count() or 1)):
        parser.error(f"--threads {args.threads}: use auto or a core count from 1 to {os.cpu_count()}")
    if args.child:
        child(args)
        return
    names = list(CONFIGS) if args.config == "both" else [args.config]
    print(f"concurrency {args.concurrency}, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, "
          f"{args.dtype}, threads {args.threads}, {os.cpu_count()} CPUs")  # fmt: skip
    engines = list(ENGINES) if args.engine == "both" else [args.engine]
    for name in names:
        ref = run_child("transformers", name, args)
        print(f"{name:7s} transformers: {ref['threads']:.0f} threads, prefill {ref['prefill_tok_s']:.1f} tok/s, "
              f"decode {ref['decode_tok_s']:.1f} tok/s, peak RSS {ref['peak_rss_mib']:.0f} MiB")  # fmt: skip
        for engine in engines:
            ours = run_child("vllm", name, args, ENGINES[engine])
            label = f"ours, {engine} engine"
            print(f"{name:7s} {label} ({ours['threads']:.0f} threads)")
            for key in ("prefill_tok_s", "decode_tok_s", "peak_rss_mib"):
                print(f"{name:7s}   {key:14s} ours {ours[key]:10.1f}  transformers {ref[key]:10.1f}  "
                      f"ratio {ours[key] / ref[key]:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
