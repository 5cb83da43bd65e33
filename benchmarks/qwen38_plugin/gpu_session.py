"""Every GPU check of the portable Qwen4Exp in one command, for a lent GPU machine with the kit
of ../shared/docs/h200-vllm.md installed (stock vLLM 0.32 and this checkout's plugins):

    python3 benchmarks/qwen38_plugin/gpu_session.py $OUT [--skip ops,exact,bench,tp2]

1. ``ops``: the CUDA tests of the kernels (QSA paged ops, varlen GDN / PLE, fla's GDN), natively
   and in CUDA graphs.
2. ``exact``: stock vLLM serving the tiny checkpoint with our model, CUDA graphs on (vLLM's
   default), concurrent mixed-length prompts, chunked prefill and prefix-cache hits, in both GPU
   model runners (V2, vLLM's default on GPUs, and V1): fp32 greedy tokens against transformers on
   the same GPU (must be identical), fp16 against transformers fp16 (identical until the first
   step where transformers' own top two logprobs nearly tie; counts and margins are printed).
3. ``bench``: benchmarks/qwen38_plugin/bench_gpu.py (medium config, fp16, batches 1 / 8 / 64 / 256,
   eager and CUDA graphs, transformers, stock's bf16 model if it starts).
4. ``tp2`` (two GPUs): the fp32 tokens of 2. at ``tensor_parallel_size=2`` equal TP=1's.

Each step runs in a child process with a time limit, so one failure does not stop the others;
results are written to OUT as they come (a command stopped at its limit still returns them), and
a summary is printed last.
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
STEPS = 32
EOS = 248046


def prompts(seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randint(0, 248_000, (n,), generator=gen).tolist() for n in (1, 3, 29, 70, 45, 300)]
    ps[3][33] = EOS
    # shared prefixes: the last two continue the 300-token prompt (prefix-cache hits)
    ps += [[*ps[5][:256], 11, 12, 13], ps[5] + [7] * 20]
    return ps


def run(name: str, cmd: list[str], out: Path, timeout: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    start = time.time()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, check=False
        )
        status, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        status, log = 124, f"{exc.stdout}\n{exc.stderr}\ntimed out after {timeout} s"
    (out / f"{name}.log").write_text(log)
    return {"status": status, "seconds": round(time.time() - start, 1), "tail": log[-1500:]}


def engine_tokens(
    model: Path, dtype: str, tp: int, out: Path, tag: str, env: dict[str, str] | None = None
) -> list[list[int]] | None:
    extra = {"max_num_batched_tokens": 64, "max_num_seqs": 16, "tensor_parallel_size": tp}
    cmd = [sys.executable, str(ROOT / "tests/qwen38_plugin/qwen38_engine_greedy.py"), str(model), dtype, str(STEPS),
           json.dumps(prompts(0)), json.dumps(extra)]  # fmt: skip
    result = run(f"engine-{tag}", cmd, out, 600, env)
    lines = [line for line in (out / f"engine-{tag}.log").read_text().splitlines() if line.startswith('{"tokens"')]
    tokens: list[list[int]] | None = json.loads(lines[-1])["tokens"] if lines else None
    if tokens is None:
        print(f"engine {tag} failed: {result['tail'][-800:]}", flush=True)
    return tokens


def reference(model: Path, dtype: str) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens and, per step, the margin between its top two logprobs."""
    import torch
    from transformers import Qwen4ExpForCausalLM

    hf = Qwen4ExpForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).cuda().eval()
    tokens, margins = [], []
    with torch.no_grad():
        for p in prompts(0):
            ids = torch.tensor([p], device="cuda")
            gen = hf.generate(ids, max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)  # fmt: skip
            tokens.append(gen.sequences[0, len(p) :].tolist())
            top = [torch.log_softmax(s[0].float(), -1).topk(2).values for s in gen.scores]
            margins.append([float(t[0] - t[1]) for t in top])
    return tokens, margins


def exact(out: Path, tp2: bool) -> dict[str, Any]:
    """Both of vLLM's GPU model runners: V2 (vLLM's default where Triton exists; the CPU runs V1,
    so V2 is untested elsewhere) and V1."""
    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint

    report: dict[str, Any] = {}
    for dtype in ("float32", "float16"):
        model = out / f"tiny-{dtype}"
        if not model.exists():
            build_tiny_checkpoint(model, "qwen4_exp_text", dtype=dtype)
        ref, margins = reference(model, dtype)
        for runner, env in (("v2", {}), ("v1", {"VLLM_USE_V2_MODEL_RUNNER": "0"})):
            served = engine_tokens(model, dtype, 1, out, f"{dtype}-{runner}-tp1", env)
            key = f"{dtype}-{runner}"
            if served is None:
                report[key] = {"error": "engine failed"}
                continue
            equal = [sum(a == b for a, b in zip(s, r, strict=True)) for s, r in zip(served, ref, strict=True)]
            first = [next((i for i, (a, b) in enumerate(zip(s, r, strict=True)) if a != b), None)
                     for s, r in zip(served, ref, strict=True)]  # fmt: skip
            report[key] = {
                "identical_prompts": sum(e == STEPS for e in equal), "prompts": len(equal), "equal_tokens": equal,
                "reference_margin_at_first_difference": [m[i] if i is not None else None
                                                         for m, i in zip(margins, first, strict=True)],
            }  # fmt: skip
            if tp2 and dtype == "float32":
                tp2_tokens = engine_tokens(model, dtype, 2, out, f"{dtype}-{runner}-tp2", env)
                report[f"tp2-{runner}-float32-equals-tp1"] = tp2_tokens == served
            (out / "exact.json").write_text(json.dumps(report, indent=2))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--skip", default="")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    import torch

    gpus = torch.cuda.device_count()
    summary: dict[str, Any] = {"gpus": gpus, "name": torch.cuda.get_device_name() if gpus else None}
    if "ops" not in skip:
        tests = [
            "tests/qwen38_plugin/cuda",
            "tests/qwen38_plugin/test_qwen38_qsa_paged.py",
            "tests/qwen38_plugin/test_qwen38_gdn_varlen.py",
            "tests/qwen38_plugin/test_qwen38_ple_varlen.py",
        ]
        cmd = [sys.executable, "-m", "pytest", "--noconftest", "-q", "-rA", "-p", "no:cacheprovider", *tests]
        summary["ops"] = run("ops", cmd, out, 420, {"PYTHONPATH": f"{ROOT / 'src/qwen38_plugin'}:{ROOT}"})
        print("ops:", summary["ops"]["status"], summary["ops"]["tail"][-300:], flush=True)
    if "exact" not in skip:
        summary["exact"] = exact(out, tp2=gpus >= 2 and "tp2" not in skip)
        print("exact:", json.dumps(summary["exact"]), flush=True)
    if "bench" not in skip:
        cmd = [sys.executable, str(ROOT / "benchmarks/qwen38_plugin/bench_gpu.py"), str(out / "bench"), "--stock"]
        summary["bench"] = run("bench", cmd, out, 1500)
        print(summary["bench"]["tail"], flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
