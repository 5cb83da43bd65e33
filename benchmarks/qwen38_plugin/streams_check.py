"""bench_mtp_trained.py's target streams from transformers (`hf_streams`, 64 sequences a forward)
against the plain-torch oracle's (each sequence alone): seconds per sequence of each, and the gap
between them by layer on the first sequences (`oracle_gap`: median and largest position).

    python benchmarks/qwen38_plugin/streams_check.py OUT [--config medium] [--sequences 128] [--work DIR]

Random token ids (the streams' semantics do not depend on the text), the config's checkpoint with
random weights in fp16 on CUDA (fp32 on CPU), both sides in fp32 as bench_mtp_trained.py runs them.
Writes OUT/streams_check.json and prints it. Runs so far: results/streams_check_cpu.txt.
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
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model = bench.build_checkpoint(args.work, args.config, "float16" if device == "cuda" else "float32")
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

    gaps = {}
    for index in indices:
        try:
            gaps[index] = bench.oracle_gap([s[index] for s in ours[: len(checked)]], [s[index] for s in oracle])
        except RuntimeError as error:
            gaps[index] = {"error": str(error)}
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
        "config": args.config,
        "sequences": args.sequences,
        "length": LENGTH,
        "transformers_s": round(hf_s, 3),
        "transformers_s_per_sequence": round(hf_s / args.sequences, 5),
        "oracle_sequences": len(checked),
        "oracle_s_per_sequence": round(oracle_s / len(checked), 5),
        "speedup_per_sequence": round((oracle_s / len(checked)) / (hf_s / args.sequences), 1),
        "oracle_gap_by_layer": gaps,
        "gap_limit": bench.ORACLE_GAP_LIMIT,
    }
    (args.out / "streams_check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
