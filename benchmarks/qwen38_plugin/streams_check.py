"""bench_mtp_trained.py's target streams from transformers (`hf_streams`, 64 sequences a forward)
against the plain-torch oracle's (each sequence alone): seconds per sequence of each, and the gap
between them by layer on the first sequences (`oracle_gap`: median and largest position).

    python benchmarks/qwen38_plugin/streams_check.py OUT [--config medium] [--sequences 128] [--work DIR]
        [--model CKPT --generated FILE]

By default random token ids and the config's checkpoint with random weights in fp16 on CUDA (fp32
on CPU); ``--model`` and ``--generated`` take bench_mtp_trained.py's pretrained target and its
generated text instead (the files it keeps under its ``--work``), where a trained target's top-k
near-ties can move the gap (results/h200_bench_mtp_trained.txt, 2026-12-07). Both sides run in
fp32 as bench_mtp_trained.py runs them. Each layer's gap is printed beside the gap to the oracle's
layers next to it, the margin `oracle_gap` holds a wrong hook to.
Writes OUT/streams_check.json and prints it. Runs so far: results/streams_check_cpu.txt,
results/streams_check_gpu.txt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_mtp_trained as bench  # (the functions it times, found through the path above)

LENGTH = 144  # bench_mtp_trained's sequences: a 16-token prompt and 128 generated tokens


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", default="medium")
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--oracle-sequences", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/streams_check"))
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: --config's, random weights)")
    parser.add_argument(
        "--generated", type=Path, help="bench_mtp_trained.py's generated-*.json: its first --sequences sequences"
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model is not None and not (args.model / "config.json").is_file():
        sys.exit(f"streams_check.py: --model {args.model} has no config.json; give a checkpoint directory")
    model = args.model or bench.build_checkpoint(args.work, args.config, "float16" if device == "cuda" else "float32")
    if args.generated is not None:
        generated = json.loads(args.generated.read_text())
        if not isinstance(generated, dict) or not generated.get("sequences"):
            sys.exit(f"streams_check.py: --generated {args.generated} has no 'sequences' (give a generated-*.json)")
        sequences = generated["sequences"][: args.sequences]
    else:
        gen = torch.Generator().manual_seed(0)
        sequences = [torch.randint(0, 240_000, (LENGTH,), generator=gen).tolist() for _ in range(args.sequences)]
    core, _ = bench.load_oracle(model, device, with_head=False)
    depth = core.config.num_hidden_layers
    indices = list(range(depth + 1))

    bench.hf_streams(model, sequences[:2], indices, device)  # warm-up: loads, kernels' first launches
    sync(device)
    start = time.perf_counter()
    ours = bench.hf_streams(model, sequences, indices, device)
    sync(device)
    hf_s = time.perf_counter() - start

    checked = sequences[: args.oracle_sequences]
    start = time.perf_counter()
    oracle = bench.target_streams(core, checked, device, indices)
    sync(device)
    oracle_s = time.perf_counter() - start

    gaps: dict[int, dict[str, object]] = {}
    for index in indices:
        mine, theirs = [s[index] for s in ours[: len(checked)]], [s[index] for s in oracle]
        next_to = [[s[j] for s in oracle] for j in (index - 1, index + 1) if 0 <= j <= depth]
        gap = bench.oracle_gap_report(mine, theirs, next_to)
        gaps[index] = {**gap, "passes": bench.gap_passes(gap)}
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
        "config": None if args.model is not None else args.config,
        "model": str(model),
        "text": str(args.generated) if args.generated is not None else "random token ids",
        "sequences": len(sequences),
        "length": len(sequences[0]),
        "transformers_s": round(hf_s, 3),
        "transformers_s_per_sequence": round(hf_s / len(sequences), 5),
        "oracle_sequences": len(checked),
        "oracle_s_per_sequence": round(oracle_s / len(checked), 5),
        "speedup_per_sequence": round((oracle_s / len(checked)) / (hf_s / len(sequences)), 1),
        "oracle_gap_by_layer": gaps,
        "gap_limit": bench.ORACLE_GAP_LIMIT,
        "layer_margin": bench.ORACLE_LAYER_MARGIN,
    }
    (args.out / "streams_check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
