"""Run-time compilation of this plugin's CUDA C++ kernels with NVRTC, through ctypes.

Why NVRTC through ctypes (not nvcc, not `cuda-bindings`):
- no compiler on the user's machine: NVRTC is a shared library that every CUDA build of torch
  already installs (`nvidia-cuda-nvrtc-cu12` beside a CUDA 12.x torch, `nvidia-cuda-nvrtc` 13.x
  beside PyPI's CUDA 13 torch);
- the library file is chosen explicitly: sm_70 needs NVRTC 12.x (NVRTC 13 refuses
  `--gpu-architecture=sm_70`), while `cuda-bindings` loads the NVRTC of its own major version
  (13.x in this project's CPU environment), so it could not compile for a V100 here;
- the C API used (create, compile, log, PTX, CUBIN) is stable since CUDA 11.

Which library (first found): ``VLLM_SM70_NVRTC_PATH``, then ``nvidia/cuda_nvrtc/lib/libnvrtc.so.12``
(CUDA 12 wheels) or ``nvidia/cu13/lib/libnvrtc.so.13`` (CUDA 13 wheels) on ``sys.path``, then
the dynamic loader's ``libnvrtc.so.12`` / ``libnvrtc.so.13``. For an architecture the first
library that supports it is used (sm_70: a 12.x one).

No GPU is needed: tests compile the kernels for sm_70 and sm_90 on a CPU-only machine.
This module imports neither vLLM nor a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent

# NVRTC 13 dropped every architecture below sm_75.
MIN_ARCH_BY_MAJOR = {11: 35, 12: 50, 13: 75}


class NvrtcError(RuntimeError):
    pass


@dataclass(frozen=True)
class Nvrtc:
    path: str
    version: tuple[int, int]
    lib: ctypes.CDLL

    def supports(self, arch: int) -> bool:
        return arch >= MIN_ARCH_BY_MAJOR.get(self.version[0], 0)


@dataclass(frozen=True)
class Compiled:
    arch: int
    ptx: str
    cubin: bytes
    log: str
    nvrtc_version: tuple[int, int]


def _candidate_paths() -> list[str]:
    paths: list[str] = []
    explicit = os.environ.get("VLLM_SM70_NVRTC_PATH")
    if explicit:
        paths.append(explicit)
    for entry in sys.path:
        for relative in ("nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "nvidia/cu13/lib/libnvrtc.so.13"):
            candidate = Path(entry or ".") / relative
            if candidate.is_file():
                paths.append(str(candidate))
    paths += ["libnvrtc.so.12", "libnvrtc.so.13"]
    return list(dict.fromkeys(paths))


@functools.cache
def available_nvrtcs() -> tuple[Nvrtc, ...]:
    """Every NVRTC library that loads, in the order of `_candidate_paths`, one per version."""
    found: dict[tuple[int, int], Nvrtc] = {}
    for path in _candidate_paths():
        try:
            # NVRTC dlopens libnvrtc-builtins.so.<major>.<minor> at compile time; the wheels keep it
            # beside libnvrtc without a search path to it, so load it first (global symbols).
            for builtins in sorted(Path(path).parent.glob("libnvrtc-builtins.so.*")) if "/" in path else []:
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        major, minor = ctypes.c_int(), ctypes.c_int()
        if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
            continue
        version = (major.value, minor.value)
        found.setdefault(version, Nvrtc(path, version, lib))
    return tuple(found.values())


def nvrtc_for(arch: int) -> Nvrtc:
    """The first NVRTC that compiles for ``sm_<arch>``; an error naming what was found otherwise."""
    nvrtcs = available_nvrtcs()
    for nvrtc in nvrtcs:
        if nvrtc.supports(arch):
            return nvrtc
    seen = ", ".join(f"{n.version[0]}.{n.version[1]} ({n.path})" for n in nvrtcs) or "none"
    hint = " (NVRTC 13 dropped sm_70: install nvidia-cuda-nvrtc-cu12, or set VLLM_SM70_NVRTC_PATH)" if arch < 75 else ""
    raise NvrtcError(f"no NVRTC library compiles for sm_{arch}; found: {seen}{hint}")


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        message = lib.nvrtcGetErrorString(result)
        raise NvrtcError(f"{what}: {message.decode() if message else result}")


def kernel_source(name: str = "flash_v100.cu") -> str:
    return (KERNEL_DIR / name).read_text()


def compile_source(
    source: str,
    arch: int,
    defines: dict[str, int] | None = None,
    name: str = "kernel.cu",
    nvrtc: Nvrtc | None = None,
    verbose_ptxas: bool = True,
) -> Compiled:
    """PTX and a cubin of ``source`` for ``sm_<arch>``; the log carries ptxas's resource usage."""
    nvrtc = nvrtc or nvrtc_for(arch)
    lib = nvrtc.lib
    options = [f"--gpu-architecture=sm_{arch}", "--std=c++17", "-lineinfo"]
    options += [f"-D{key}={value}" for key, value in sorted((defines or {}).items())]
    if verbose_ptxas:
        options.append("--ptxas-options=-v")
    program = ctypes.c_void_p()
    _check(
        lib,
        lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        encoded = [o.encode() for o in options]
        result = lib.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log_buffer = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log_buffer)
        log = log_buffer.value.decode(errors="replace")
        if result != 0:
            raise NvrtcError(f"NVRTC {nvrtc.version} failed to compile {name} for sm_{arch} ({options}):\n{log}")
        _check(lib, lib.nvrtcGetPTXSize(program, ctypes.byref(size)), "nvrtcGetPTXSize")
        ptx = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
        _check(lib, lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return Compiled(arch, ptx.value.decode(), cubin.raw, log, nvrtc.version)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def cache_dir() -> Path:
    root = os.environ.get("VLLM_SM70_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vllm", "sm70_backend"
    )
    return Path(root)


def compile_cached(source: str, arch: int, defines: dict[str, int], name: str) -> Compiled:
    """`compile_source`, with the cubin kept on disk under a hash of source, options and NVRTC."""
    nvrtc = nvrtc_for(arch)
    key = hashlib.sha256(repr((source, arch, sorted(defines.items()), nvrtc.version)).encode()).hexdigest()[:24]
    directory = cache_dir()
    cubin_path = directory / f"{Path(name).stem}-sm{arch}-{key}.cubin"
    if cubin_path.is_file():
        return Compiled(arch, "", cubin_path.read_bytes(), "(cached)", nvrtc.version)
    compiled = compile_source(source, arch, defines, name, nvrtc)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = cubin_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(compiled.cubin)
        tmp.replace(cubin_path)
    except OSError:
        pass  # a read-only cache directory only costs a compile per process
    return compiled
