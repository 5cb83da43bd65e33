"""Every GPU check of the portable Qwen4Exp, for a lent GPU machine with the kit of
../shared/docs/h200-vllm.md installed (stock vLLM 0.32 and this checkout's plugins):

    python3 benchmarks/qwen38_plugin/gpu_session.py OUT [--only ops,exact,tp2,bench]
        [--runners v2,v1] [--dtypes float16,bfloat16] [--modes graphs,compiled,eager]
        [--work /tmp/qwen38_gpu_session]

1. ``ops``: the CUDA tests of the kernels (QSA paged ops, varlen GDN / PLE, fla's GDN), natively
   and in CUDA graphs.
2. ``exact``: stock vLLM serving the tiny checkpoint with our model, CUDA graphs on in both of
   vLLM's ways (``graphs``: its default for this architecture, breakable CUDA graphs without
   torch.compile; ``compiled``: torch.compile, full graphs for decode steps and piecewise graphs
   around our ops otherwise; ``eager``), prompts of 1 to 320 tokens, first each alone and then
   all together (concurrent mixed lengths, chunked prefill at 64 tokens a step, prefix-cache hits
   on the shared prefixes), in the GPU model runners named by ``--runners`` (V2, vLLM's default
   on GPUs, and V1, the one the CPU runs), against transformers in the same dtype on the same GPU:
   greedy tokens identical over 32 steps until the first step where transformers' own top two
   logprobs nearly tie (``NEAR_TIE``; counts and margins are recorded). float32 is refused on
   CUDA (vLLM's GDN prefill kernel has no float32); the CPU tests prove float32 bit-exactness.
3. ``tp2`` (two GPUs): 2. at ``tensor_parallel_size=2`` in the first of ``--dtypes``, by the same
   rule, and whether its tokens equal TP=1's.
4. ``bench``: benchmarks/qwen38_plugin/bench_gpu.py (medium config, fp16, batches 1 / 8 / 64 / 256,
   eager and CUDA graphs, transformers, stock's bf16 model if it starts).

Each engine runs in a child process with a time limit, so one failure does not stop the others;
results are written to OUT as they come (``exact.json``, ``summary.json``, one log per child), so
a command stopped at its limit still returns them. Checkpoints go under ``--work``, reused by
later calls on the same machine.
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
    """Run a child, its output streamed into OUT/<name>.log (kept when a limit stops the child or us)."""
    start = time.time()
    path = out / f"{name}.log"
    with path.open("w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            status = 124
            log_file.write(f"\ntimed out after {timeout} s\n")
    log = path.read_text(errors="replace")
    return {"status": status, "seconds": round(time.time() - start, 1), "tail": log[-1500:]}


NEAR_TIE = {"float16": 2**-8, "bfloat16": 2**-5}  # as tests/qwen38_plugin/qwen38_reference.py
ENGINE = {"max_num_batched_tokens": 64, "max_num_seqs": 16, "solo": True, "disable_log_stats": False}


def engine_run(
    model: Path, dtype: str, out: Path, tag: str, env: dict[str, str] | None = None, **extra: Any
) -> dict[str, Any] | None:
    """The engine's tokens: {"tokens" (together), "solo", "prefix_cache_hits", ...} or None."""
    cmd = [sys.executable, str(ROOT / "tests/qwen38_plugin/qwen38_engine_greedy.py"), str(model), dtype, str(STEPS),
           json.dumps(prompts(0)), json.dumps({**ENGINE, **extra})]  # fmt: skip
    result = run(f"engine-{tag}", cmd, out, 420, env)
    lines = [line for line in (out / f"engine-{tag}.log").read_text().splitlines() if line.startswith('{"tokens"')]
    if not lines:
        print(f"engine {tag} failed: {result['tail'][-800:]}", flush=True)
        return None
    served: dict[str, Any] = json.loads(lines[-1])
    served["seconds"] = result["seconds"]
    return served


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
    del hf
    torch.cuda.empty_cache()
    return tokens, margins


def compare(served: list[list[int]], ref: list[list[int]], margins: list[list[float]], dtype: str) -> dict[str, Any]:
    """Equal tokens per prompt; fp32 must be identical, other dtypes until a near tie of the reference."""
    first = [next((i for i, (a, b) in enumerate(zip(s, r, strict=True)) if a != b), None)
             for s, r in zip(served, ref, strict=True)]  # fmt: skip
    at_difference = [m[i] if i is not None else None for m, i in zip(margins, first, strict=True)]
    if dtype == "float32":
        ok = all(i is None for i in first)
    else:
        ok = all(m is None or m < NEAR_TIE[dtype] for m in at_difference)
    return {"ok": ok, "identical_prompts": sum(i is None for i in first), "prompts": len(first),
            "first_difference": first, "reference_margin_at_first_difference": at_difference}  # fmt: skip


def checkpoint(work: Path, dtype: str) -> Path:
    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint

    model = work / f"tiny-{dtype}"
    if not model.exists():
        build_tiny_checkpoint(model, "qwen4_exp_text", dtype=dtype)
    return model


def exact(out: Path, work: Path, runners: list[str], dtypes: list[str], modes: list[str]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for dtype in dtypes:
        model = checkpoint(work, dtype)
        ref, margins = reference(model, dtype)
        (work / f"reference-{dtype}.json").write_text(json.dumps({"tokens": ref, "margins": margins}))
        for runner in runners:
            for mode in modes:
                key = f"{dtype}-{runner}-{mode}"
                env = {**RUNNER_ENV[runner], **MODE_ENV[mode]}
                served = engine_run(model, dtype, out, key, env, enforce_eager=mode == "eager")
                if served is None:
                    report[key] = {"ok": False, "error": "engine failed: see engine-" + key + ".log"}
                else:
                    report[key] = {
                        "together": compare(served["tokens"], ref, margins, dtype),
                        "solo": compare(served["solo"], ref, margins, dtype),
                        "prefix_cache_hits": served.get("prefix_cache_hits"),
                        "preemptions": served.get("preemptions"), "seconds": served["seconds"],
                    }  # fmt: skip
                    report[key]["ok"] = report[key]["together"]["ok"] and report[key]["solo"]["ok"]
                    (work / f"tokens-{key}.json").write_text(json.dumps(served["tokens"]))
                (out / "exact.json").write_text(json.dumps(report, indent=2))
                print(key, json.dumps(report[key]), flush=True)
    return report


def tp2(out: Path, work: Path, runners: list[str], dtype: str) -> dict[str, Any]:
    """``tensor_parallel_size=2`` against transformers (the rule of `compare`) and TP=1's tokens."""
    report: dict[str, Any] = {}
    model = checkpoint(work, dtype)
    ref_file = work / f"reference-{dtype}.json"
    if not ref_file.exists():
        ref, margins = reference(model, dtype)
        ref_file.write_text(json.dumps({"tokens": ref, "margins": margins}))
    reference_run = json.loads(ref_file.read_text())
    ref, margins = reference_run["tokens"], reference_run["margins"]
    for runner in runners:
        key = f"{dtype}-{runner}-graphs-tp2"
        served = engine_run(model, dtype, out, key, RUNNER_ENV[runner], tensor_parallel_size=2)
        tp1_file = work / f"tokens-{dtype}-{runner}-graphs.json"
        tp1 = json.loads(tp1_file.read_text()) if tp1_file.exists() else None
        if served is None:
            report[key] = {"ok": False, "error": f"engine failed: see engine-{key}.log"}
        else:
            report[key] = {"together": compare(served["tokens"], ref, margins, dtype),
                           "solo": compare(served["solo"], ref, margins, dtype),
                           "equals_tp1": served["tokens"] == tp1 if tp1 is not None else "TP=1 not run",
                           "seconds": served["seconds"]}  # fmt: skip
            report[key]["ok"] = report[key]["together"]["ok"] and report[key]["solo"]["ok"]
        (out / "tp2.json").write_text(json.dumps(report, indent=2))
        print(key, json.dumps(report[key]), flush=True)
    return report


RUNNER_ENV = {"v2": {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
# graphs: vLLM's default for the Qwen4ExpForCausalLM architecture on CUDA, breakable CUDA graphs
# without torch.compile; compiled: torch.compile with piecewise and full CUDA graphs.
MODE_ENV = {"graphs": {}, "compiled": {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}, "eager": {}}
STEPS_OF_SESSION = ("ops", "exact", "tp2", "bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", default=",".join(STEPS_OF_SESSION))
    parser.add_argument("--runners", default="v2,v1")
    parser.add_argument("--dtypes", default="float16,bfloat16", help="of the exact step (float32: refused on CUDA)")
    parser.add_argument("--modes", default="graphs,compiled,eager", help="of the exact step")
    parser.add_argument("--work", type=Path, default=Path("/tmp/qwen38_gpu_session"))
    parser.add_argument("--bench-args", default="", help="extra arguments for bench_gpu.py")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    unknown = only - set(STEPS_OF_SESSION)
    if unknown:
        parser.error(f"--only: unknown steps {sorted(unknown)}; choose from {', '.join(STEPS_OF_SESSION)}")
    runners = [r for r in args.runners.split(",") if r]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    import torch

    gpus = torch.cuda.device_count()
    summary: dict[str, Any] = {"gpus": gpus, "name": torch.cuda.get_device_name() if gpus else None}
    if "ops" in only:
        tests = [
            "tests/qwen38_plugin/cuda",
            "tests/qwen38_plugin/test_qwen38_qsa_paged.py",
            "tests/qwen38_plugin/test_qwen38_fused_ops.py",
            "tests/qwen38_plugin/test_qwen38_gdn_varlen.py",
            "tests/qwen38_plugin/test_qwen38_ple_varlen.py",
        ]
        cmd = [sys.executable, "-m", "pytest", "--noconftest", "-q", "-rA", "-p", "no:cacheprovider", *tests]
        path = f"{ROOT / 'src/qwen38_plugin'}:{ROOT}:{os.environ.get('PYTHONPATH', '')}"
        summary["ops"] = run("ops", cmd, out, 420, {"PYTHONPATH": path})
        print("ops:", summary["ops"]["status"], summary["ops"]["tail"][-300:], flush=True)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if "exact" in only:
        summary["exact"] = exact(out, args.work, runners, dtypes, args.modes.split(","))
    if "tp2" in only:
        summary["tp2"] = tp2(out, args.work, runners, dtypes[0]) if gpus >= 2 else "needs two GPUs"
    if "bench" in only:
        cmd = [sys.executable, str(ROOT / "benchmarks/qwen38_plugin/bench_gpu.py"), str(out), "--stock",
               "--work", str(args.work), *args.bench_args.split()]  # fmt: skip
        summary["bench"] = run("bench", cmd, out, 3000)
        print(summary["bench"]["tail"], flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
