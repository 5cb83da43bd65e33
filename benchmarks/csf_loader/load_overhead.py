"""Load-time overhead of NVFP4-CSF against the uncompressed checkpoint, measured in one run.

    python benchmarks/csf_loader/load_overhead.py NVFP4_DIR CSF_DIR [--repeats 5]

Times the host-side weight stream the `csf` load format feeds to a model: every tensor
of every shard read from safetensors (page cache warm: one untimed pass first), and
for CSF the same stream through `decode_csf_stream` (validation + decode of every
plane). Reports medians and the ratio. The engine's own "Loading weights took" line
adds model-side copies, equal for both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from csf_loader.stream import decode_csf_stream


def stream(root: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def consume(it: Iterator[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in it)


def timed(fn: object, repeats: int) -> float:
    assert callable(fn)
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("csf", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    plain = timed(lambda: consume(stream(args.source)), args.repeats)
    csf = timed(lambda: consume(decode_csf_stream(stream(args.csf))), args.repeats)
    size = sum(p.stat().st_size for p in args.source.glob("*.safetensors"))
    csf_size = sum(p.stat().st_size for p in args.csf.glob("*.safetensors"))
    print(
        f"uncompressed {size / 1e6:.1f} MB: {plain * 1e3:.1f} ms; CSF {csf_size / 1e6:.1f} MB: {csf * 1e3:.1f} ms; "
        f"overhead {100 * (csf / plain - 1):+.1f} % (torch threads {torch.get_num_threads()})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
