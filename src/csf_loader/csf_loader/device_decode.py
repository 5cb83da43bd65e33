"""Decode CSF scale planes where the weights go (no vLLM import).

One dispatcher for the ``csf`` load format's weight stream, picked by the device the model's
parameters live on:

* CUDA: the compressed streams (fixed bytes and exception words) are checked where they arrive
  (``codec.validate_plane``'s checks and messages: on the host for a plane streamed from a file),
  cross to the device in one queued copy from a pinned staging ring (``StagingRing``) and are
  decoded by the Triton kernel (``triton_decode``) into a device tensor. The decoded planes never exist in host
  memory; what crosses PCIe is the compressed payload.
* CPU (and anything else): the plain-torch codec on the host, optionally only a tensor-parallel
  rank's region of the plane (``codec.decode_region``).

``CSF_LOADER_DECODE`` overrides the choice: ``auto`` (the rule above), ``torch`` (the torch codec on
whatever device the parameters are on) or ``triton`` (the Triton kernel on any device, e.g. on
CPU tensors under ``TRITON_INTERPRET=1``, which is how the CPU tests drive the device path).
An out-of-memory error on the device names the tensor and the bytes it needed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from csf_loader.codec import CsfCodec, CsfFormatError, CsfPlane, check_plane_layout, check_plane_values, decode_region
from csf_loader.triton_decode import HAVE_TRITON, decode_triton_stacked

ENV = "CSF_LOADER_DECODE"
KERNELS = ("auto", "torch", "triton")

Region = tuple[tuple[int, int], tuple[int, int]]


class DecodeConfigError(ValueError):
    """``CSF_LOADER_DECODE`` names no decoder, or one this environment cannot run."""


class DeviceMemoryError(RuntimeError):
    """The device ran out of memory decoding a plane; the message names it and the bytes needed."""


def kernel_for(device: torch.device, requested: str | None = None) -> str:
    """The kernel, "triton" or "torch", for planes decoded onto ``device``: ``requested`` (else
    ``CSF_LOADER_DECODE``) "auto" picks Triton on CUDA (where triton is installed), torch elsewhere."""
    choice = (requested if requested is not None else os.environ.get(ENV, "auto")).strip() or "auto"
    if choice not in KERNELS:
        raise DecodeConfigError(
            f"{ENV}={choice!r}: use auto (the Triton kernel on CUDA, the torch codec elsewhere), torch or triton"
        )
    if choice == "auto":
        return "triton" if device.type == "cuda" and HAVE_TRITON else "torch"
    if choice == "triton" and not HAVE_TRITON:
        raise DecodeConfigError(f"{ENV}=triton: triton is not installed; install it or use {ENV}=torch")
    return choice


def _device_empty(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The decoded plane's buffer (one place, so tests can make it fail)."""
    return torch.empty(shape, dtype=torch.uint8, device=device)


def _plane_layout(plane: CsfPlane) -> tuple[int, int, int]:
    """Offsets of the words and the fixed stream in a staged plane's buffer, and its size."""
    words_at = 16
    fixed_at = words_at + 4 * plane.exceptions.numel()
    return words_at, fixed_at, fixed_at + plane.fixed.numel()


def _fill_staging(host: torch.Tensor, plane: CsfPlane) -> None:
    """Write ``[starts: 2 x int64 | words: count x uint32 | fixed bytes]`` into ``host``."""
    words_at, fixed_at, _ = _plane_layout(plane)
    host[:words_at].view(torch.int64).copy_(torch.tensor([0, plane.exceptions.numel()], dtype=torch.int64))
    host[words_at:fixed_at].view(torch.int32).copy_(plane.exceptions.view(torch.int32).reshape(-1).cpu())
    host[fixed_at:].copy_(plane.fixed.reshape(-1).cpu())


def _staged_views(staged: torch.Tensor, plane: CsfPlane) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    words_at, fixed_at, _ = _plane_layout(plane)
    return (
        staged[fixed_at:].view(plane.fixed.shape),
        staged[words_at:fixed_at].view(torch.uint32),
        staged[:words_at].view(torch.int64),
    )


class StagingRing:
    """Host memory that planes cross to the device from, reused round the ring.

    On CUDA the ring is pinned, so a plane's copy is queued and the host goes on to the next
    tensor at once (a copy from pageable memory returns only when it has landed). A region is
    written again only after the device has read it: when the next plane does not fit before
    the ring's end, the host waits for the copies queued so far (once per ``capacity`` bytes)
    and starts again at the front. A plane larger than the ring crosses alone from pageable
    memory (``stage_plane``). Elsewhere (CPU tensors, the tests) the ring is plain memory and
    each copy completes before it returns.
    """

    def __init__(self, device: torch.device, capacity: int = 8 << 20) -> None:
        self.device = torch.device(device)
        self.capacity = capacity
        self.buffer: torch.Tensor | None = None
        self.offset = 0
        self.waits = 0  # times the host waited for queued copies before reusing the ring

    def stage(self, plane: CsfPlane) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size = _plane_layout(plane)[2]
        if size > self.capacity:
            return stage_plane(plane, self.device)
        if self.buffer is None:
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        start = -(-self.offset // 16) * 16  # 16-byte aligned, so the int64 starts stay aligned
        if start + size > self.capacity:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self.waits += 1
            start = 0
        host = self.buffer[start : start + size]
        _fill_staging(host, plane)
        staged = torch.empty(size, dtype=torch.uint8, device=self.device)
        staged.copy_(host, non_blocking=True)
        self.offset = start + size
        return _staged_views(staged, plane)


@dataclass
class PlaneDecoder:
    """Decodes every plane of a weight stream onto ``device`` with the kernel chosen for it.

    Keeps counts for the loader's log line: planes, those decoded over a region only, decoded
    bytes, seconds (host wall time, device copies and checks included) and of them the seconds
    spent staging planes from the host (``StagingRing``: filling the ring, queueing the copy).
    """

    device: torch.device
    kernel: str = field(default="")
    planes: int = 0
    partial: int = 0
    decoded_bytes: int = 0
    seconds: float = 0.0
    copy_seconds: float = 0.0
    staging: StagingRing | None = None

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.kernel = kernel_for(self.device, self.kernel or None)
        if self.staging is None:
            self.staging = StagingRing(self.device)

    @property
    def on_host(self) -> bool:
        return self.device.type == "cpu" and self.kernel == "torch"

    def describe(self) -> str:
        kernel = "the Triton kernel" if self.kernel == "triton" else "the torch codec"
        return f"on {self.device} with {kernel}"

    def decode(
        self, plane: CsfPlane, codec: CsfCodec, rows: int, cols: int, what: str, region: Region | None = None
    ) -> torch.Tensor:
        """The ``[rows, cols]`` uint8 scale plane on ``self.device``.

        With ``region`` (the torch codec only) only ``scales[r0:r1, c0:c1]`` is decoded from the
        compressed payload; the other bytes of the returned full-shape tensor are undefined (a
        tensor-parallel rank's weight loader reads exactly its region). The Triton kernel always
        decodes the whole plane (microseconds on the device). Errors name ``what``.
        """
        started = time.perf_counter()
        if self.kernel == "triton" or region == ((0, rows), (0, cols)):
            region = None
        try:
            if self.kernel == "triton":
                scales = self._decode_triton(plane, codec, rows, cols, what)
            else:
                scales = self._decode_torch(plane, codec, rows, cols, what, region)
        finally:
            self.seconds += time.perf_counter() - started
        self.planes += 1
        self.partial += region is not None
        self.decoded_bytes += scales.numel()
        return scales

    def _checked_on_device(self, plane: CsfPlane, codec: CsfCodec, rows: int, cols: int, what: str) -> CsfPlane:
        """The plane checked (``codec.validate_plane``'s checks and messages) and on the device:
        dtypes and shapes before anything is copied, the values where the bytes are when they
        arrive (a plane streamed from the file: on the host, before the copy, so the checks cost
        the GPU no reads back, which each wait for every copy queued before them)."""
        check_plane_layout(plane, codec, rows, cols, what)
        check_plane_values(plane, codec, rows, cols, what)
        if plane.fixed.device != self.device or plane.exceptions.device != self.device:
            plane = CsfPlane(plane.fixed.to(self.device), plane.exceptions.to(self.device))
        return plane

    def _staged_on_device(
        self, plane: CsfPlane, codec: CsfCodec, rows: int, cols: int, what: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The plane's fixed stream, exception words and ``[0, count]`` word starts on the device
        (a host plane through the staging ring), checked as in ``_checked_on_device``."""
        check_plane_layout(plane, codec, rows, cols, what)
        check_plane_values(plane, codec, rows, cols, what)
        if plane.fixed.device == self.device and plane.exceptions.device == self.device:
            starts = torch.tensor([0, plane.exceptions.numel()], dtype=torch.int64, device=self.device)
            return plane.fixed, plane.exceptions, starts
        assert self.staging is not None
        started = time.perf_counter()
        try:
            return self.staging.stage(plane)
        finally:
            self.copy_seconds += time.perf_counter() - started

    def _decode_triton(self, plane: CsfPlane, codec: CsfCodec, rows: int, cols: int, what: str) -> torch.Tensor:
        try:
            fixed, words, starts = self._staged_on_device(plane, codec, rows, cols, what)
            out = _device_empty((rows, cols), self.device)
            return decode_triton_stacked(fixed, words, starts, codec, 1, rows, cols, out, words.numel())
        except torch.OutOfMemoryError:
            raise DeviceMemoryError(self._oom_message(plane, rows, cols, what)) from None

    def _decode_torch(
        self, plane: CsfPlane, codec: CsfCodec, rows: int, cols: int, what: str, region: Region | None
    ) -> torch.Tensor:
        try:
            on_device = self._checked_on_device(plane, codec, rows, cols, what)
            if region is None:
                return decode_region(on_device, codec, rows, cols, (0, rows), (0, cols), validate=False, what=what)
            (r0, r1), (c0, c1) = region
            scales = _device_empty((rows, cols), self.device)
            scales[r0:r1, c0:c1] = decode_region(
                on_device, codec, rows, cols, (r0, r1), (c0, c1), validate=False, what=what
            )
            return scales
        except torch.OutOfMemoryError:
            raise DeviceMemoryError(self._oom_message(plane, rows, cols, what)) from None

    def _oom_message(self, plane: CsfPlane, rows: int, cols: int, what: str) -> str:
        fixed, words = plane.fixed.numel(), 4 * plane.exceptions.numel()
        needed = fixed + words + rows * cols
        free = ""
        if self.device.type == "cuda":
            try:
                available, total = torch.cuda.mem_get_info(self.device)
                free = f"; {available:,} of {total:,} bytes free on {self.device}"
            except RuntimeError:  # pragma: no cover - the device is gone
                pass
        return (
            f"{what}: out of memory on {self.device} decoding this scale plane: it needs {needed:,} bytes there "
            f"(compressed stream {fixed:,} + exception words {words:,} + decoded [{rows}, {cols}] {rows * cols:,})"
            f"{free}. Free device memory (lower --gpu-memory-utilization's share taken before loading, or use a "
            f"larger tensor-parallel size)"
        )


def stage_plane(plane: CsfPlane, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A host plane's fixed stream, exception words and ``[0, count]`` word starts on ``device``, in
    one copy from pageable memory (the staging ring's way for a plane larger than the ring).

    The buffer is ``[starts: 2 x int64 | words: count x uint32 | fixed bytes]``; each part begins
    aligned to its element size (16 and 16 + 4 * count are multiples of 4, and the kernel reads an
    NVFP4 fixed stream as int32 units), so one copy carries what would otherwise be three."""
    host = torch.empty(_plane_layout(plane)[2], dtype=torch.uint8)
    _fill_staging(host, plane)
    return _staged_views(host.to(device), plane)


__all__ = [
    "ENV",
    "KERNELS",
    "CsfFormatError",
    "DecodeConfigError",
    "DeviceMemoryError",
    "PlaneDecoder",
    "kernel_for",
    "stage_plane",
]
