"""Decode/prefill throughput and peak memory: our model inside stock vLLM (CPU) vs transformers.

    .venv/bin/python benchmarks/qwen38_plugin/bench_cpu.py [--config tiny|medium|both] [--concurrency 8]

For each config it builds a random checkpoint (cached under .cache/bench/), then measures on
this machine, one after the other:
- transformers `Qwen4ExpForCausalLM.generate` (greedy), all requests as one batch (the
  prompts have equal lengths, so no padding is involved);
- stock vLLM with the plugin (`vllm.LLM`, the same prompts, all requests submitted at once).
Prefill tokens/s uses max_tokens=1; decode tokens/s uses (generated tokens) / (total - prefill time).
Peak memory is the sum of the peak RSS (VmHWM) of the measuring process and its live
descendants (vLLM's engine core and worker processes included).
Prints one table and the ratios ours / transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
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


def measure_transformers(model: Path, ps: list[list[int]], new_tokens: int) -> dict[str, float]:
    import torch
    from transformers import Qwen4ExpForCausalLM

    hf = Qwen4ExpForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    # All prompts have the same length, so they run as one batch without padding.
    ids = torch.tensor(ps)
    with torch.no_grad():
        hf.generate(ids[:1, :8], max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
        t1 = time.perf_counter()
        hf.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        t2 = time.perf_counter()
    return _rates(ps, new_tokens, t1 - t0, t2 - t1)


def measure_vllm(model: Path, ps: list[list[int]], new_tokens: int) -> dict[str, float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model), dtype="float32", max_model_len=1024, seed=0, max_num_seqs=len(ps))
    inputs = [TokensPrompt(prompt_token_ids=p) for p in ps]
    llm.generate(inputs[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    llm.generate(inputs, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(inputs, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    t2 = time.perf_counter()
    return _rates(ps, new_tokens, t1 - t0, t2 - t1)


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


def child(kind: str, name: str, concurrency: int, prompt_len: int, new_tokens: int) -> None:
    model = checkpoint(name)
    ps = prompts(concurrency, prompt_len)
    result = (measure_vllm if kind == "vllm" else measure_transformers)(model, ps, new_tokens)
    print("RESULT " + json.dumps(result), flush=True)


def run_child(kind: str, name: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", kind, "--config", name, "--concurrency", str(args.concurrency),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]  # fmt: skip
    if kind == "vllm":
        cmd = ["flock", "/tmp/qwen38-vllm.lock", *cmd]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{kind} {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result: dict[str, float] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=[*CONFIGS, "both"], default="both")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--child", choices=["vllm", "transformers"])
    args = parser.parse_args()
    if args.child:
        child(args.child, args.config, args.concurrency, args.prompt_len, args.new_tokens)
        return
    names = list(CONFIGS) if args.config == "both" else [args.config]
    print(f"concurrency {args.concurrency}, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, fp32, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    for name in names:
        ours, ref = run_child("vllm", name, args), run_child("transformers", name, args)
        for key in ("prefill_tok_s", "decode_tok_s", "peak_rss_mib"):
            print(f"{name:7s} {key:14s} ours {ours[key]:10.1f}  transformers {ref[key]:10.1f}  "
                  f"ratio {ours[key] / ref[key]:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
