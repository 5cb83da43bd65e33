"""Does stock vLLM on this device draft what the reference drafts, DFlash's or the MTP head's?

On the H200 (2026-12-02) a trained DFlash drafter predicted at 3.97 was accepted at 2.27, and a
trained MTP head had its first draft accepted every time and its second never, while on CPU the
same recipes accepted what their references predicted. This runs, where vLLM serves (on a GPU its
V2 runner, in the serving dtype, with CUDA graphs if asked), the comparisons the CPU tests make
(tests/dflash2/test_drafter_reference.py, tests/qwen38_plugin/test_qwen38_mtp_drafts_engine.py),
against the fp32 references:

    python benchmarks/qwen38_plugin/drafts_check.py OUT [--method dflash|mtp] [--dtype float16] [--graphs]

The tiny Qwen4Exp target (fp32 weights) and, for ``dflash``, the test's random one-layer drafter,
for ``mtp`` the target's random MTP head; three greedy requests together (``--requests 1``: the first
alone), 3 drafts a step, every
step's drafts recorded from stock's scheduler (V1 runner) or, where vLLM's V2 runner keeps them on
the device (CUDA), from its draft handler. The MTP head's later drafts read its own output streams
and its K/V of the positions drafted before them, which the V1 and V2 runners prepare through
different code. Prints, for each draft position, how many drafts differ, and how many of those
differ where the reference's top two logits are clearly apart (more than ``--clear-margin``):
those are not the dtype's noise. OUT/drafts_check.json holds the drafts, the reference's and the
margins. On CPU with ``--dtype float32`` and no ``--graphs`` it is the tests' comparison (a check of
this script). On CPU, 2026-12-02 (DFlash): float32 0 of 99 drafts differ; bfloat16 9 differ, none
clearly (all within 0.05 of a tie); float16 0 differ; 2026-12-03 (MTP): float32 0 of 99; 2026-12-04 (MTP,
``--requests 1``): float32 0 of 33; 2026-12-06 (DFlash, ``--drafts 4``): float32 0 of 132 (three requests) and 0 of 44
(``--requests 1``). On the H200
(V2 runner) float32 is refused (vLLM's GDN prefill kernel); the first DFlash run there, before the
draft handler was read, recorded only placeholders (now refused: nothing compared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--method", choices=["dflash", "mtp"], default="dflash")
    parser.add_argument("--dtype", default="float16", help="the engine's dtype (the references stay fp32)")
    parser.add_argument("--graphs", action="store_true", help="vLLM's CUDA graphs (default: enforce_eager)")
    parser.add_argument("--clear-margin", type=float, default=0.05)
    parser.add_argument("--work", type=Path, default=Path("/tmp/drafts_check"))
    parser.add_argument("--timeout", type=int, default=400, help="seconds for the engine")
    parser.add_argument(
        "--requests",
        type=int,
        choices=[1, 2, 3],
        default=3,
        help="how many of the three prompts the engine serves together (1: the first alone, a batch of one)",
    )
    parser.add_argument("--drafts", type=int, default=3, help="draft tokens a step (the drafter is built for them)")
    args = parser.parse_args()
    if args.drafts < 1:
        parser.error(f"--drafts {args.drafts}: give at least 1")
    # read by the test module at import (the drafter's block) and by the engine subprocess (its speculative config)
    os.environ["DRAFTER_CHECK_DRAFTS"] = str(args.drafts)

    import torch

    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint
    from tests.dflash2.test_drafter_reference import build_drafter, engine_command, engine_result, reference_drafts
    from tests.qwen38_plugin.test_qwen38_mtp_drafts_engine import MTP, mtp_reference_drafts

    args.out.mkdir(parents=True, exist_ok=True)
    target = args.work / f"target-{args.method}"
    if not target.exists():
        build_tiny_checkpoint(
            target, "qwen4_exp_text", overrides=MTP if args.method == "mtp" else None, dtype="float32"
        )
    drafter_dir, drafter = args.work / f"drafter-{args.drafts}", None
    if args.method == "dflash":
        shutil.rmtree(drafter_dir, ignore_errors=True)
        drafter = build_drafter(target, drafter_dir)
    env = {**os.environ, "DRAFTER_CHECK_DTYPE": args.dtype, "DRAFTER_CHECK_GRAPHS": "1" if args.graphs else "0",
           "DRAFTER_CHECK_METHOD": args.method,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    if not torch.cuda.is_available():
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    log = args.out / "engine.log"
    # (--requests: 2026-12-04's concurrency 1 accepted less than 4 and 8 on the H200, and these checks had run
    # three requests together)
    command = engine_command(target, drafter_dir, args.requests)
    with log.open("w") as f:
        # the engine's own log goes to stdout (vLLM's logger): kept beside stderr's
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=f, text=True,
                              env=env, timeout=args.timeout, check=False)  # fmt: skip
    (args.out / "engine.stdout").write_text(proc.stdout)
    if proc.returncode != 0:
        sys.exit(f"the engine failed (exit {proc.returncode}); its logs: {log}, {args.out / 'engine.stdout'}")
    result = engine_result(proc.stdout)
    served = [step["drafts"] for step in result["drafts"]]
    if not served or any(-1 in drafts for drafts in served):
        sys.exit("drafts were not recorded (-1 placeholders): the engine's runner hands its drafts somewhere "
                 "record_device_drafts does not read; nothing compared")  # fmt: skip
    if args.method == "mtp":
        reference, margins = mtp_reference_drafts(target, result)
    else:
        reference, flat_margins = reference_drafts(target, drafter, result)
        margins, at = [], 0
        for drafts in served:
            margins.append(flat_margins[at : at + len(drafts)])
            at += len(drafts)
    by_position: dict[int, dict[str, int]] = {}
    for got, want, margin in zip(served, reference, margins, strict=True):
        for j, (d, r) in enumerate(zip(got, want, strict=False)):
            counts = by_position.setdefault(j + 1, {"drafts": 0, "differ": 0, "differ_clearly": 0})
            counts["drafts"] += 1
            counts["differ"] += d != r
            counts["differ_clearly"] += d != r and margin[j] > args.clear_margin
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU", "method": args.method,
               "dtype": args.dtype, "graphs": args.graphs, "requests": args.requests, "steps": len(served),
               "drafts_per_step": args.drafts,
               "drafts": sum(c["drafts"] for c in by_position.values()),
               "differ": sum(c["differ"] for c in by_position.values()),
               "differ_clearly": sum(c["differ_clearly"] for c in by_position.values()),
               "by_draft_position": by_position, "clear_margin": args.clear_margin,
               "tokens_identical_to_reference_drafts": all(c["differ"] == 0 for c in by_position.values())}  # fmt: skip
    (args.out / "drafts_check.json").write_text(
        json.dumps(
            {**summary, "served": served, "reference": reference, "margins": margins, "engine": result}, indent=1
        )
    )
    print("drafts " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
