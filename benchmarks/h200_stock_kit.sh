#!/usr/bin/env bash
# What stock vLLM's own Qwen4Exp needs on the lent H200 beyond ../shared/tools/h200-vllm-kit's five
# folders (issue 10: "try stock's Qwen4Exp in bf16 ... report ours against stock side by side if it
# runs, or what stops it"): FlashInfer (stock's GDN prefill and the norm kernels its QSA indexer
# imports), NVIDIA's CUTLASS DSL and quack-kernels (its hyper-connection kernels; the fused HC
# down + SiLU imports quack.compile_utils when it first compiles, in vLLM's CUDA-graph memory
# profile: on 2026-12-06 stock's engine stopped there on "No module named 'quack'"), at the versions
# vLLM 0.32.0's wheel pins (flashinfer-python==0.7.0.post1, nvidia-cutlass-dsl[cu13]==4.8.0,
# quack-kernels==0.6.5), with the packages they import that the H200 image lacks (its image has
# cuda-bindings, cuda-core, cuda-pathfinder, nvidia-ml-py, ninja, einops and nvcc 13.0, which
# FlashInfer's JIT uses). Left out: vLLM's tilelang pin (only its mHC layer imports it) and quack's
# torch-c-dlpack-ext (no quack module imports it; its 0.1.5 wheel holds builds for torch 2.4-2.9 only).
#
#     bash benchmarks/h200_stock_kit.sh      # from the project root, after h200-vllm-kit: .kit6 ...
#
# A device call carries at most 64 MiB with the working tree, so each folder stays under 55 MB and
# a wheel larger than that (the CUTLASS DSL's 92 MB cu13 libraries) is cut into parts NAME.partK,
# joined on the device. On the device, after the five calls of ../shared/docs/h200-vllm.md, one
# call per folder (carry [".kit6"], ...): `mkdir -p /tmp/kit2 && cp .kit6/* /tmp/kit2/`, and in the
# last one, before the work:
#
#     cd /tmp/kit2 && for p in *.part0; do [ -e "$p" ] || continue; w=${p%.part0}; cat "$w".part* >"$w" \
#       && rm "$w".part*; done && python3 -m pip install -q --no-index --no-deps --no-compile \
#       --target /tmp/site *.whl && cd - && export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0
#
# then `bash benchmarks/h200_session.sh b $OUT` with BENCH_ARGS="--modes graphs --stock ...". That
# script also puts /tmp/site/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH, which the DSL's .pth file
# would do in a site directory (--target runs no .pth); run bench_gpu.py directly and you must add it. The folders
# are git-excluded (/.kit*/, as the first five). Needs pip access to PyPI (this machine has it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
    manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$wheels" \
    flashinfer-python==0.7.0.post1 \
    nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0 \
    nvidia-cutlass-dsl-libs-cu13==4.8.0 \
    nvidia-cudnn-frontend==1.32.0 cuda-tile==1.7.0 nccl4py==0.6.0 nccl-extensions==0.1.0 \
    quack-kernels==0.6.5
python3 - "$wheels" <<'EOF'
import hashlib
import shutil
import sys
from pathlib import Path

LIMIT = 55_000_000  # bytes a folder, leaving the working tree room under the 64 MiB a call carries
PART = 45_000_000
source = Path(sys.argv[1])
pieces: list[Path] = []
for wheel in sorted(source.glob("*.whl")):
    if wheel.stat().st_size <= LIMIT:
        pieces.append(wheel)
        continue
    data = wheel.read_bytes()
    for k, start in enumerate(range(0, len(data), PART)):
        part = source / f"{wheel.name}.part{k}"
        part.write_bytes(data[start : start + PART])
        pieces.append(part)
    print(f"{wheel.name}: {len(data):,} bytes cut into {k + 1} parts (sha256 {hashlib.sha256(data).hexdigest()[:16]})")
for old in Path(".").glob(".kit[6-9]"):
    shutil.rmtree(old)
folders: list[tuple[Path, int]] = []
for piece in sorted(pieces, key=lambda p: -p.stat().st_size):  # first fit, largest first
    size = piece.stat().st_size
    for i, (folder, used) in enumerate(folders):
        if used + size <= LIMIT:
            folders[i] = (folder, used + size)
            break
    else:
        folder = Path(f".kit{6 + len(folders)}")
        if 6 + len(folders) > 9:
            raise SystemExit("h200_stock_kit: more than four folders (.kit6-.kit9) would be needed")
        folder.mkdir()
        folders.append((folder, size))
        i = len(folders) - 1
    shutil.copy(piece, folders[i][0] / piece.name)
for folder, used in folders:
    print(f"{folder}: {len(list(folder.iterdir()))} files, {used / 1e6:.1f} MB")
EOF
