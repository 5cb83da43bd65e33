"""What a compiled kernel contains: SASS instruction counts and ptxas's resource report.

No GPU needed. The disassembler is the ``nvdisasm`` that Triton bundles (CUDA 13.x). CUDA 13's
tools refuse sm_70 cubins ("SM70 is deprecated"), so an sm_70 cubin is disassembled with its ELF
header's architecture relabelled sm_75: Volta and Turing share the instruction encoding, and the
relabelled cubin decodes to Volta's sequences (an ``mma.sync.aligned.m8n8k4`` f32 is four
``HMMA.884.F32.F32.STEP0..3``; loads carry Volta's ``.SYS`` scope).
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

E_FLAGS_OFFSET = 0x30  # ELF64 header
SM_MASK = 0xFF00FF  # EF_CUDA_SM and EF_CUDA_VIRTUAL_SM fields


def nvdisasm_path() -> str | None:
    try:
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


def cubin_arch(cubin: bytes) -> int:
    (flags,) = struct.unpack_from("<I", cubin, E_FLAGS_OFFSET)
    return flags & 0xFF


def relabel(cubin: bytes, arch: int) -> bytes:
    data = bytearray(cubin)
    (flags,) = struct.unpack_from("<I", data, E_FLAGS_OFFSET)
    struct.pack_into("<I", data, E_FLAGS_OFFSET, (flags & ~SM_MASK) | arch | (arch << 16))
    return bytes(data)


def disassemble(cubin: bytes) -> str:
    tool = nvdisasm_path()
    if tool is None:
        raise FileNotFoundError("no nvdisasm (Triton's bundled one or on PATH)")
    if cubin_arch(cubin) == 70:
        cubin = relabel(cubin, 75)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        result = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {result.stderr.strip()}")
    return result.stdout


def functions(sass: str) -> dict[str, list[str]]:
    """Function name -> its instruction lines (opcode with modifiers first)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        header = re.match(r"^\s*\.text\.(\S+):", line)
        if header:
            current = header.group(1)
            out[current] = []
            continue
        ins = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if ins and current is not None:
            out[current].append(ins.group(1))
    return out


def opcode_counts(sass: str) -> dict[str, Counter[str]]:
    return {name: Counter(ops) for name, ops in functions(sass).items()}


def resource_usage(log: str) -> dict[str, dict[str, int]]:
    """ptxas -v report per kernel: registers, spill stores / loads (bytes), stack frame (bytes)."""
    usage: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
            usage[current] = {}
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            usage[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            usage[current]["registers"] = int(m.group(1))
    return usage
