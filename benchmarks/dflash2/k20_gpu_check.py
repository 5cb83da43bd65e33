"""K20 inside a GPU engine: adaptive verification with dflash2's acceptance estimator, against stock's.

    python benchmarks/dflash2/k20_gpu_check.py OUT [--drafts 4] [--tokens 320] [--dtype float16|float32] [--eager]
    python benchmarks/dflash2/k20_gpu_check.py OUT --dry-run     # on CPU: the runs without adaptive verification

Stock vLLM 0.32 runs its online acceptance estimator only with ``enable_adaptive_verification`` in
Model Runner V2 (a GPU), and only where every attention backend of the target takes device-trimmed
query lengths: the SSM backends opt out (``AttentionBackend.supports_device_cpu_query_lens_mismatch``),
so a target with Gated DeltaNet layers (Qwen3-Next, Qwen4Exp) is refused at startup with it. The
check therefore serves the tiny Qwen3 target (attention only) with the tiny random DFlash drafter
(`dflash2.tiny`), ``--drafts`` drafts, eight concurrent greedy requests of ``--tokens`` tokens
(several of stock's 100-step refits), three times, each in its own vLLM child
(tests/dflash2/spec_engine_run.py):

* ``robust``: adaptive verification with dflash2's estimator (the default once the plugin is
  installed); its log must say that the engine built dflash2's estimator (its constructor logs it;
  installing the class alone proves nothing: vLLM imports stock's module on CPU too);
* ``stock``: the same with ``DFLASH2_ACCEPTANCE_ESTIMATOR=stock``;
* ``none``: no speculation.

Printed (and in OUT/k20_gpu_check.json): whether each run's greedy tokens equal ``none``'s (and
where each request first differs), whether the engine built the robust estimator (and not in
``stock``), vLLM's per-request counters (drafts proposed and accepted: vLLM counts a request's
proposed drafts there, verified or not) and, counted inside the engine (``spec_engine_run.py``'s
``count_adaptive_verification``), the drafts scheduled and the drafts adaptive verification let
through to the target, and the longest run of steps that scheduled drafts and verified none. A
random drafter's drafts are almost never accepted, so stock's estimator may learn to verify none
(its collapse: seen in float16, 32 of 10,208 drafts verified on an H100); whether it does also rests
on the draft budget, which weighs confidences against the step costs vLLM measures at startup (in
float32 stock verified 3,008 of them). The robust estimator's exploration verifies one draft per
request after 16 steps that graded none, so the verdict asks that its longest run of steps verifying
no draft stay within 32 (the draft budget reads confidences a step or two old; a collapse runs for
hundreds of steps). The verified counts of both are reported, not judged.

Verification keeps the output exact whatever the estimator decides, but which drafts are verified
changes the target's query lengths and so its kernels' rounding: the unspeculated run records its
top-two logprob gap at every token, and a speculative run passes where it equals that run or first
differs from it at a near tie (gap below ``NEAR_TIE``: 2^-8 in float16, 2^-12 in float32).

Stock refuses adaptive verification without full CUDA graphs (``Adaptive verification requires full
CUDA graphs``, seen on an H100 on 2026-12-07), so the engines run with vLLM's CUDA graphs;
``--eager`` shows that refusal. ``--dry-run`` runs the same on CPU (vLLM's V1 runner) without
adaptive verification, which proves the script, not K20.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the repository's tools package
from tools.token_compare import first_differences, margins_at, only_near_ties  # noqa: E402

RUNNER = ROOT / "tests" / "dflash2" / "spec_engine_run.py"
BUILT = "dflash2: adaptive verification's acceptance estimator built"
REQUESTS = 8
# Below these top-two logprob gaps of the unspeculated run, a speculative run's different query lengths
# (hence kernels and rounding) may pick the other token: fp16's as tests/qwen38_plugin/qwen38_reference.py;
# fp32's, rounding of a few 1e-6 in the logits of this tiny model, with a wide margin.
NEAR_TIE = {"float16": 2**-8, "float32": 2**-12}
EXPLORE_AFTER = 16  # dflash2.acceptance.ROBUST.explore_after_idle_steps, checked in main()


def build(work: Path, dtype: str) -> tuple[Path, Path]:
    from dflash2.tiny import build_tiny_drafter
    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint

    target = work / f"qwen3-{dtype}"
    if not target.exists():
        build_tiny_checkpoint(target, "qwen3", dtype=dtype)
    drafter = work / f"dflash-drafter-{dtype}"
    if not drafter.exists():
        build_tiny_drafter(drafter, target)
    return target, drafter


def request_prompts() -> list[list[int]]:
    """The eight requests' prompts (token ids, fixed by a seed)."""
    import torch

    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 240_000, (n,), generator=gen).tolist() for n in (5, 17, 3, 40, 9, 26, 12, 60)]


def run(args: argparse.Namespace, name: str, target: Path, spec: dict[str, Any] | None) -> dict[str, Any]:
    prompts = request_prompts()
    extra: dict[str, Any] = {"dtype": args.dtype, "max_num_seqs": REQUESTS, "max_model_len": 512,
                             "enforce_eager": args.eager, "disable_log_stats": False}  # fmt: skip
    env = dict(os.environ)
    if name == "stock":
        env["DFLASH2_ACCEPTANCE_ESTIMATOR"] = "stock"
    if args.dry_run:
        extra.update(gpu_memory_utilization=0.05)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    else:
        extra.update(gpu_memory_utilization=0.3)
        if spec is not None:
            extra["count_adaptive_verification"] = True
    if spec is None:
        extra["logprobs"] = 2  # the unspeculated run's top-two gaps judge where a speculative run differs
    cmd = [sys.executable, str(RUNNER), str(target), json.dumps(spec), json.dumps(prompts),
           json.dumps([args.tokens] * REQUESTS), json.dumps(extra)]  # fmt: skip
    log = args.out / f"{name}.log"
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env, timeout=args.timeout)
    text = log.read_text(errors="replace")
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"tokens"')]
    result: dict[str, Any] = {"returncode": proc.returncode, "robust_estimator_built": BUILT in text + proc.stdout}
    if proc.returncode or not lines:
        result["log_tail"] = (text + proc.stdout)[-3000:]
        return result
    out = json.loads(lines[-1])
    result["tokens"] = out["tokens"]
    result["drafts_proposed"] = sum(sum(d) for d in out["drafted"])
    result["drafts_accepted"] = sum(sum(a) for a in out["accepted"])
    result["verify_steps"] = sum(len(d) for d in out["drafted"])
    if "adaptive" in out:
        result["adaptive"] = out["adaptive"]
    if "margins" in out:
        result["margins"] = out["margins"]
    return result


def judge_differences(tokens: list[list[int]], reference: list[list[int]], margins: list[list[float | None]],
                      dtype: str) -> dict[str, Any]:  # fmt: skip
    """Where each request first differs from the unspeculated run, that run's top-two gap there; the
    tokens pass when every difference lies at a near tie (gap below ``NEAR_TIE[dtype]``)."""
    first = first_differences(tokens, reference)
    at = margins_at(first, margins)
    bound = NEAR_TIE[dtype]
    return {"tokens_equal_no_speculation": tokens == reference, "first_differences": first,
            "reference_margin_at_first_difference": at, "near_tie_bound": bound,
            "tokens_ok": only_near_ties(first, at, bound)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=320, help="greedy tokens per request (refits every 100 steps)")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--eager", action="store_true", help="enforce_eager (stock then refuses adaptive verification)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/k20_gpu_check"))
    parser.add_argument("--timeout", type=int, default=400, help="seconds per vLLM child")
    parser.add_argument("--dry-run", action="store_true", help="on CPU, without adaptive verification")
    parser.add_argument("--runs", default="robust,stock,none", help="which runs (none is always among them)")
    args = parser.parse_args()
    from dflash2.acceptance import ROBUST

    if ROBUST.explore_after_idle_steps != EXPLORE_AFTER:
        raise SystemExit(f"EXPLORE_AFTER={EXPLORE_AFTER} but dflash2 explores after {ROBUST.explore_after_idle_steps}")
    if args.dtype not in NEAR_TIE:
        raise SystemExit(f"--dtype {args.dtype}: use one of {', '.join(NEAR_TIE)}")
    if args.dry_run:
        args.dtype, args.tokens = "float32", min(args.tokens, 24)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    target, drafter = build(args.work, args.dtype)
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": args.drafts,
            "enable_adaptive_verification": not args.dry_run}  # fmt: skip
    report: dict[str, Any] = {"drafts": args.drafts, "tokens": args.tokens, "requests": REQUESTS,
                              "dtype": args.dtype, "eager": args.eager, "dry_run": args.dry_run}  # fmt: skip
    unknown = set(args.runs.split(",")) - {"robust", "stock", "none"}
    chosen = [name for name in ("robust", "stock") if name in args.runs.split(",")] + ["none"]
    if unknown or len(chosen) < 2:
        raise SystemExit(f"--runs {args.runs}: name robust and/or stock (none always runs), comma-separated")
    runs = {name: run(args, name, target, spec if name != "none" else None) for name in chosen}
    speculative = chosen[:-1]
    reference, margins = runs["none"].get("tokens"), runs["none"].get("margins")
    for name in speculative:
        tokens = runs[name].get("tokens")
        if tokens is not None and reference is not None and margins is not None:
            runs[name].update(judge_differences(tokens, reference, margins, args.dtype))
    report["runs"] = {name: {k: v for k, v in r.items() if k not in ("tokens", "margins")} for name, r in runs.items()}
    (args.out / "k20_gpu_check.json").write_text(json.dumps(report, indent=2))
    for name, r in report["runs"].items():
        print(f"k20 {name}: " + json.dumps({k: v for k, v in r.items() if k != "log_tail"}), flush=True)
        if "log_tail" in r:
            print(r["log_tail"][-1500:], flush=True)
    adaptive = {name: runs[name].get("adaptive", {}) for name in speculative}
    # The robust estimator predicts acceptance 1 for each request's first draft after EXPLORE_AFTER idle steps;
    # the draft budget reads confidences a step or two old (stock's record_confidences copies them to the host
    # behind the step), so the bound leaves a period's slack: it tells exploration from a collapse (hundreds of
    # steps), and the measured run length is printed.
    idle_bound = 2 * EXPLORE_AFTER
    robust_idle = adaptive.get("robust", {}).get("longest_idle", idle_bound + 1)
    ok = (
        all(runs[name]["returncode"] == 0 and runs[name].get("tokens_ok", False) for name in speculative)
        and ("robust" not in runs or runs["robust"]["robust_estimator_built"] or args.dry_run)
        and ("stock" not in runs or not runs["stock"]["robust_estimator_built"])
        and ("robust" not in runs or args.dry_run or robust_idle <= idle_bound)
    )
    counts = "; ".join(
        f"{name}: {adaptive[name].get('verified')} drafts verified, longest run of steps verifying none "
        f"{adaptive[name].get('longest_idle')}" for name in speculative
    )  # fmt: skip
    print(f"k20 verdict: {'ok' if ok else 'NOT ok'} ({counts}; the robust run's at most {idle_bound} required; token "
          f"differences only at near ties below {NEAR_TIE[args.dtype]})", flush=True)  # fmt: skip
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
