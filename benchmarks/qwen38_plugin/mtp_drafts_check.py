"""Does stock vLLM draft with the portable MTP head what the head's plain-torch oracle drafts?

On the H200 (2026-12-02) an MTP head trained on the target's text had its first draft accepted
every time and its second never (acceptance length 2.00 with 3 drafts), while on CPU the same
recipe accepted every draft (3.00 with 2). The draft steps after the first read the head's own
output streams and its K/V of the positions drafted just before; vLLM's V1 runner (CPU) and its
V2 runner (CUDA) run those steps through different code (V2: the target-dependent speculator,
its draft-step metadata rebuilt each step, the draft QSA layer on the target's caches). This
compares every draft, by position, with `qwen38_plugin.mtp_reference` (fp32), the way
`dflash_drafts_check.py` compares DFlash's:

    python benchmarks/qwen38_plugin/mtp_drafts_check.py OUT [--dtype float16] [--graphs]

The tiny Qwen4Exp with a random MTP head (fp32 weights), three greedy requests of 5 / 23 / 41
random tokens together, 3 drafts a step, each step's drafts recorded from stock's scheduler (V1)
or the V2 runner's draft handler (`tests/dflash2/test_drafter_reference.py`'s engine side, with
``DRAFTER_CHECK_METHOD=mtp``). The reference for a step of a request with ``L`` tokens (the last
one just sampled) is ``Qwen4ExpMTPReference.draft`` over those ``L`` tokens and the oracle
target's streams (from tests/qwen38_plugin/test_qwen38_mtp_drafts_engine.py, the CPU test of the
same). Prints, for each draft position, how many drafts differ and how many of those differ
clearly (the reference's top two logits more than ``--clear-margin`` apart); the result's
``tokens_identical_to_reference_drafts`` is the verdict. OUT/mtp_drafts_check.json holds every
draft, the reference's and the margins. On CPU (V1 runner, fp32), 2026-12-03: 0 of 99 differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="float16", help="the engine's dtype (the reference stays fp32)")
    parser.add_argument("--graphs", action="store_true", help="vLLM's CUDA graphs (default: enforce_eager)")
    parser.add_argument("--clear-margin", type=float, default=0.05)
    parser.add_argument("--work", type=Path, default=Path("/tmp/mtp_drafts_check"))
    parser.add_argument("--timeout", type=int, default=400, help="seconds for the engine")
    args = parser.parse_args()

    import torch

    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint
    from tests.dflash2.test_drafter_reference import engine_command, engine_result
    from tests.qwen38_plugin.test_qwen38_mtp_drafts_engine import MTP, mtp_reference_drafts

    args.out.mkdir(parents=True, exist_ok=True)
    target = args.work / "target"
    if not target.exists():
        build_tiny_checkpoint(target, "qwen4_exp_text", overrides=MTP, dtype="float32")
    env = {**os.environ, "DRAFTER_CHECK_DTYPE": args.dtype, "DRAFTER_CHECK_GRAPHS": "1" if args.graphs else "0",
           "DRAFTER_CHECK_METHOD": "mtp",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    if not torch.cuda.is_available():
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    log = args.out / "engine.log"
    with log.open("w") as f:
        proc = subprocess.run(engine_command(target, Path("unused")), stdout=subprocess.PIPE, stderr=f, text=True,
                              env=env, timeout=args.timeout, check=False)  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"the engine failed (exit {proc.returncode}); its log: {log}")
    result = engine_result(proc.stdout)
    served = [s["drafts"] for s in result["drafts"]]
    if not served or any(-1 in d for d in served):
        sys.exit("drafts were not recorded (-1 placeholders): the engine's runner hands its drafts somewhere "
                 "record_device_drafts does not read; nothing compared")  # fmt: skip
    drafts, margins = mtp_reference_drafts(target, result)
    by_position: dict[int, dict[str, int]] = {}
    for got, want, margin in zip(served, drafts, margins, strict=True):
        for j, (d, r) in enumerate(zip(got, want, strict=False)):
            counts = by_position.setdefault(j + 1, {"drafts": 0, "differ": 0, "differ_clearly": 0})
            counts["drafts"] += 1
            counts["differ"] += d != r
            counts["differ_clearly"] += d != r and margin[j] > args.clear_margin
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU", "dtype": args.dtype,
               "graphs": args.graphs, "steps": len(served), "by_draft_position": by_position,
               "tokens_identical_to_reference_drafts": all(c["differ"] == 0 for c in by_position.values())}  # fmt: skip
    (args.out / "mtp_drafts_check.json").write_text(
        json.dumps({**summary, "served": served, "reference": drafts, "margins": margins, "engine": result}, indent=1)
    )
    print("mtp drafts " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
