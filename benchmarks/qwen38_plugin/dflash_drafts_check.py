"""Does stock vLLM on this device draft what the DFlash reference drafts for the Qwen4Exp target?

tests/dflash2/test_drafter_reference.py holds `dflash2.drafter_reference` to vLLM's drafts on CPU
(fp32, eager, the V1 runner). On the H200 (2026-12-02) a trained drafter predicted at 3.97 was
accepted at 2.27: this runs the same comparison where vLLM serves on a GPU, in the serving dtype
and with CUDA graphs (vLLM's V2 runner there), against the reference in fp32:

    python benchmarks/qwen38_plugin/dflash_drafts_check.py OUT [--dtype float16] [--graphs]

The tiny Qwen4Exp target (fp32 weights) and the test's random one-layer drafter, three greedy
requests together, 3 drafts a step, every step's drafts recorded from stock's scheduler (V1 runner)
or, where vLLM's V2 runner keeps them on the device (CUDA), from its draft handler. Prints how
many drafts differ, and how many of those differ where the reference's top two logits are clearly
apart (more than ``--clear-margin``): those are not the dtype's noise. OUT/dflash_drafts_check.json
holds the drafts, the reference's and the margins. On CPU with ``--dtype float32`` and no
``--graphs`` it is the test's comparison (a check of this script). On CPU, 2026-12-02: float32 0 of
99 drafts differ; bfloat16 9 differ, none clearly (all within 0.05 of a tie); float16 0 differ.
On the H200 (V2 runner) float32 is refused (vLLM's GDN prefill kernel); the first run there, before
the draft handler was read, recorded only placeholders (now refused: nothing compared).
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
    parser.add_argument("--work", type=Path, default=Path("/tmp/dflash_drafts_check"))
    parser.add_argument("--timeout", type=int, default=400, help="seconds for the engine")
    args = parser.parse_args()

    import torch

    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint
    from tests.dflash2.test_drafter_reference import build_drafter, engine_command, engine_result, reference_drafts

    args.out.mkdir(parents=True, exist_ok=True)
    target, drafter_dir = args.work / "target", args.work / "drafter"
    if not target.exists():
        build_tiny_checkpoint(target, "qwen4_exp_text", dtype="float32")
    if drafter_dir.exists():
        import shutil

        shutil.rmtree(drafter_dir)
    drafter = build_drafter(target, drafter_dir)
    env = {**os.environ, "DRAFTER_CHECK_DTYPE": args.dtype, "DRAFTER_CHECK_GRAPHS": "1" if args.graphs else "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    if not torch.cuda.is_available():
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    log = args.out / "engine.log"
    with log.open("w") as f:
        proc = subprocess.run(engine_command(target, drafter_dir), stdout=subprocess.PIPE, stderr=f, text=True,
                              env=env, timeout=args.timeout, check=False)  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"the engine failed (exit {proc.returncode}); its log: {log}")
    result = engine_result(proc.stdout)
    drafts, margins = reference_drafts(target, drafter, result)
    served = [d for s in result["drafts"] for d in s["drafts"]]
    if not served or -1 in served:
        sys.exit(f"{served.count(-1)} of {len(served)} drafts were not recorded (-1 placeholders): the engine's "
                 "runner hands its drafts somewhere record_device_drafts does not read; nothing compared")  # fmt: skip
    ours = [d for s, ref in zip(result["drafts"], drafts, strict=True) for d in ref[: len(s["drafts"])]]
    differ = [i for i, (d, r) in enumerate(zip(served, ours, strict=True)) if d != r]
    clear = [i for i in differ if margins[i] > args.clear_margin]
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU", "dtype": args.dtype,
               "graphs": args.graphs, "drafts": len(served), "differ": len(differ), "differ_clearly": len(clear),
               "clear_margin": args.clear_margin, "tokens_identical_to_reference_drafts": not differ}  # fmt: skip
    (args.out / "dflash_drafts_check.json").write_text(
        json.dumps({**summary, "served": served, "reference": ours, "margins": margins, "engine": result}, indent=1)
    )
    print("dflash drafts " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
