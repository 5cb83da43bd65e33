"""Load cubins and launch kernels through the CUDA driver API (``libcuda.so.1``), with ctypes.

The driver comes with the NVIDIA driver on every GPU machine, so launching needs no package
beyond torch. Kernels are launched on torch's current stream (``cuLaunchKernel`` on a stream
that torch is capturing is recorded into the CUDA graph), in torch's primary context.
Every call's status is checked; a failure raises with the driver's error name.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

# CUfunction_attribute
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CudaDriverError(RuntimeError):
    pass


@functools.cache
def libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        libcuda().cuGetErrorName(result, ctypes.byref(name))
        raise CudaDriverError(f"{what} failed: {name.value.decode() if name.value else result}")


def ensure_context(device: torch.device) -> None:
    """Make torch's primary context of ``device`` current on this thread."""
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.cuda.current_stream()  # torch creates and binds the primary context lazily
        lib = libcuda()
        ctx = ctypes.c_void_p()
        check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            check(lib.cuDeviceGet(ctypes.byref(dev), device.index or 0), "cuDeviceGet")
            check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


@dataclass
class Kernel:
    name: str
    handle: ctypes.c_void_p
    max_shared: int = 0

    def set_max_shared(self, nbytes: int) -> None:
        if nbytes > self.max_shared and nbytes > 48 * 1024:
            check(
                libcuda().cuFuncSetAttribute(self.handle, MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
                f"cuFuncSetAttribute({self.name}, max dynamic shared memory {nbytes})",
            )
        self.max_shared = max(self.max_shared, nbytes)

    def launch(
        self, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int, args: list[Any], stream: int
    ) -> None:
        """``args``: ctypes scalars (c_void_p for pointers, c_int64, c_int32, c_float) in signature order."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        self.set_max_shared(shared)
        check(
            libcuda().cuLaunchKernel(
                self.handle,
                ctypes.c_uint(grid[0]),
                ctypes.c_uint(grid[1]),
                ctypes.c_uint(grid[2]),
                ctypes.c_uint(block[0]),
                ctypes.c_uint(block[1]),
                ctypes.c_uint(block[2]),
                ctypes.c_uint(shared),
                ctypes.c_void_p(stream),
                params,
                None,
            ),
            f"cuLaunchKernel({self.name}, grid {grid}, block {block}, {shared} B shared)",
        )


class Module:
    """A cubin loaded into the current context of ``device``; kernels looked up by name."""

    def __init__(self, cubin: bytes, device: torch.device) -> None:
        ensure_context(device)
        self.device = device
        self._cubin = ctypes.create_string_buffer(cubin, len(cubin))
        self.handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            check(libcuda().cuModuleLoadData(ctypes.byref(self.handle), self._cubin), "cuModuleLoadData")
        self._kernels: dict[str, Kernel] = {}

    def kernel(self, name: str) -> Kernel:
        if name not in self._kernels:
            handle = ctypes.c_void_p()
            check(libcuda().cuModuleGetFunction(ctypes.byref(handle), self.handle, name.encode()), f"{name}")
            self._kernels[name] = Kernel(name, handle)
        return self._kernels[name]


def pointer(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())
