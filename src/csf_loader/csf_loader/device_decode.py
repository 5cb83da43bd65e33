"""Decode CSF scale planes where the weights go (no vLLM import).

One dispatcher for the ``csf`` load format's weight stream, picked by the device the model's
parameters live on:

* CUDA: the compressed streams (fixed bytes and exception words) are checked where they arrive
  (``codec.validate_plane``'s checks and messages: on the host for a plane streamed from a file),
  cross to the device in one queued copy from a pinned staging ring (``StagingRing``) and are
  decoded by the Triton kernel (``triton_decode``) into a device tensor; the weight streams hand
  it planes in groups (``decode_many``): same-shape planes checked in one pass, copied together
  and decoded by one launch. The decoded planes never exist in host
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from csf_loader.codec import (
    SLAB_ROWS,
    CsfCodec,
    CsfFormatError,
    CsfPlane,
    check_plane_layout,
    check_plane_values,
    decode_region,
    exception_fields,
)
from csf_loader.triton_decode import HAVE_TRITON, decode_triton_stacked, wait_triton_start

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


def kernel_for_or_none(device: torch.device) -> str | None:
    """``kernel_for`` from the environment, or None where ``CSF_LOADER_DECODE`` is invalid (the
    loader's own call names it at startup)."""
    try:
        return kernel_for(device)
    except DecodeConfigError:
        return None


def _device_empty(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A uint8 buffer on the device: the decoded planes' and the staged copy's (one place, so tests
    can make the device allocations fail)."""
    return torch.empty(shape, dtype=torch.uint8, device=device)


def _group_layout(planes: Sequence[CsfPlane]) -> tuple[int, int, int]:
    """Offsets of the words and the fixed streams in a staged group's buffer, and its size.

    The buffer is ``[starts: (P + 1) x int64 | words: every plane's uint32 words | fixed streams
    back to back]``: the starts begin at 0, the words at a multiple of 8, the fixed streams at a
    multiple of 4 (the kernel reads an NVFP4 fixed stream as int32 units)."""
    words_at = 8 * (len(planes) + 1)
    fixed_at = words_at + 4 * sum(p.exceptions.numel() for p in planes)
    return words_at, fixed_at, fixed_at + sum(p.fixed.numel() for p in planes)


def _fill_staging(host: torch.Tensor, planes: Sequence[CsfPlane]) -> None:
    """Write the group's buffer (``_group_layout``) into ``host``."""
    words_at, fixed_at, size = _group_layout(planes)
    counts = torch.tensor([0] + [p.exceptions.numel() for p in planes], dtype=torch.int64)
    torch.cumsum(counts, 0, out=host[:words_at].view(torch.int64))
    if fixed_at > words_at:
        torch.cat(
            [p.exceptions.view(torch.int32).reshape(-1).cpu() for p in planes],
            out=host[words_at:fixed_at].view(torch.int32),
        )
    torch.cat([p.fixed.reshape(-1).cpu() for p in planes], out=host[fixed_at:size])


def _staged_views(staged: torch.Tensor, planes: Sequence[CsfPlane]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fixed streams back to back, 1-D; every plane's words; the P + 1 word starts)."""
    words_at, fixed_at, size = _group_layout(planes)
    return staged[fixed_at:size], staged[words_at:fixed_at].view(torch.uint32), staged[:words_at].view(torch.int64)


def _check_staged_values(host: torch.Tensor, planes: Sequence[CsfPlane], codec: CsfCodec, rows: int, cols: int) -> bool:
    """``check_plane_values`` for every plane of a same-shape group at once, on the staged host
    buffer: True when all pass (the caller then names the first plane that fails, plane by
    plane, with the single-plane messages)."""
    words_at, fixed_at, size = _group_layout(planes)
    bases = host[fixed_at:size].reshape(len(planes) * rows // SLAB_ROWS, -1)[:, :SLAB_ROWS]
    if bool((bases > codec.max_base).any()):
        return False
    if fixed_at == words_at:
        return True
    positions, _ = exception_fields(host[words_at:fixed_at].view(torch.uint32))
    if int(positions.max()) >= rows * cols:
        return False
    # strictly increasing inside each plane: every step but those from one plane's words to the next's
    steps = positions[1:] > positions[:-1]
    ends = host[:words_at].view(torch.int64)[1:-1]  # the staged word starts of planes 1 .. P - 1
    steps[ends[(ends > 0) & (ends < positions.numel())] - 1] = True
    return bool(steps.all())


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
        """One plane on the device: its fixed stream (in its stored shape), words and starts."""
        fixed, words, starts = self.stage_group([plane])
        return fixed.view(plane.fixed.shape), words, starts

    def stage_group(
        self, planes: Sequence[CsfPlane], check: Callable[[torch.Tensor], None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The group's buffer (``_group_layout``) on the device, in one copy; ``check`` sees the
        filled host buffer before the copy (and may raise)."""
        size = _group_layout(planes)[2]
        if size > self.capacity:
            return _stage_pageable(planes, self.device, check)
        if self.buffer is None:
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        start = -(-self.offset // 16) * 16  # 16-byte aligned, so the int64 starts stay aligned
        if start + size > self.capacity:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self.waits += 1
            start = 0
        host = self.buffer[start : start + size]
        _fill_staging(host, planes)
        if check is not None:
            check(host)
        staged = _device_empty((size,), self.device)
        staged.copy_(host, non_blocking=True)
        self.offset = start + size
        return _staged_views(staged, planes)


class _GroupValuesFailed(Exception):
    """A staged group failed its one-pass value check (the planes are then checked one by one)."""


def _check_values_in_order(jobs: Sequence[PlaneJob]) -> None:
    """``check_plane_values`` plane by plane: raises the first failing plane's error, naming it."""
    for job in jobs:
        check_plane_values(job.plane, job.codec, job.rows, job.cols, job.what)


@dataclass
class PlaneJob:
    """One plane waiting to be decoded with others (``PlaneDecoder.decode_many``)."""

    plane: CsfPlane
    codec: CsfCodec
    rows: int
    cols: int
    what: str


@dataclass
class PlaneDecoder:
    """Decodes every plane of a weight stream onto ``device`` with the kernel chosen for it.

    With the Triton kernel (``batches``) the weight streams hand it planes in groups
    (``decode_many``, up to ``batch_planes`` planes, or ``batch_bytes`` of them and the tensors
    held back between them): same-shape planes are checked in one pass, cross in one copy and are decoded by one
    launch, where one plane at a time cost a check, a copy and a launch each (about 0.7 ms a plane
    on the H200's host side, more than the source checkpoint's whole load per plane).

    Keeps counts for the loader's log line: planes, those decoded over a region only, decoded
    bytes, seconds (host wall time, device copies and checks included) and of them the seconds
    spent staging planes from the host (``StagingRing``: filling the ring, queueing the copy) and
    in the kernel's launch calls, apart for the first launch of each plane shape (in a fresh
    process Triton loads or compiles a kernel variant there: the H200 measurements of 2026-12-03
    left 0.5 s of a 0.54 s decode outside the staging).
    """

    device: torch.device
    kernel: str = field(default="")
    batch_planes: int = 128
    batch_bytes: int = 32 << 20
    planes: int = 0
    partial: int = 0
    decoded_bytes: int = 0
    seconds: float = 0.0
    copy_seconds: float = 0.0
    launches: int = 0
    launch_seconds: float = 0.0
    first_launch_seconds: float = 0.0  # of launch_seconds, the first launch of each (codec, rows, cols)
    staging: StagingRing | None = None
    launched_shapes: set[tuple[str, int, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.kernel = kernel_for(self.device, self.kernel or None)
        if self.staging is None:
            self.staging = StagingRing(self.device)

    @property
    def on_host(self) -> bool:
        return self.device.type == "cpu" and self.kernel == "torch"

    @property
    def batches(self) -> bool:
        """Whether the streams should hand this decoder planes in groups (``decode_many``)."""
        return self.kernel == "triton"

    def decode_many(self, jobs: Sequence[PlaneJob]) -> list[torch.Tensor]:
        """Each job's ``[rows, cols]`` uint8 plane on ``self.device`` (the Triton kernel), in order.

        Planes of one codec and shape go together: their values are checked in one pass over the
        staged host buffer (a failure is then named plane by plane, with ``decode``'s messages, the
        first failing plane in stream order), they cross in one copy and one launch decodes them
        into one ``[P, rows, cols]`` buffer whose rows are returned. Planes already on the device
        (not a file's) go one at a time through ``decode``."""
        started = time.perf_counter()
        results: list[torch.Tensor | None] = [None] * len(jobs)
        try:
            for k, job in enumerate(jobs):
                try:
                    check_plane_layout(job.plane, job.codec, job.rows, job.cols, job.what)
                except CsfFormatError:
                    _check_values_in_order(jobs[:k])  # an earlier plane's bad values come first
                    raise
            groups: dict[tuple[str, int, int], list[int]] = {}
            for i, job in enumerate(jobs):
                on_device = job.plane.fixed.device == self.device and self.device.type != "cpu"
                if on_device or not self.batches:
                    continue
                groups.setdefault((job.codec.name, job.rows, job.cols), []).append(i)
            try:
                for indices in groups.values():
                    for i, scales in zip(indices, self._decode_group([jobs[i] for i in indices]), strict=True):
                        results[i] = scales
            except _GroupValuesFailed:
                _check_values_in_order(jobs)  # names the first failing plane in stream order
                raise
        finally:
            self.seconds += time.perf_counter() - started
        # a plane in no group (already on the device): decode times and counts it itself
        return [
            self.decode(job.plane, job.codec, job.rows, job.cols, job.what) if scales is None else scales
            for scales, job in zip(results, jobs, strict=True)
        ]

    def _decode_group(self, jobs: Sequence[PlaneJob]) -> list[torch.Tensor]:
        assert self.staging is not None
        first = jobs[0]
        codec, rows, cols = first.codec, first.rows, first.cols
        planes = [job.plane for job in jobs]

        def check(host: torch.Tensor) -> None:
            if not _check_staged_values(host, planes, codec, rows, cols):
                raise _GroupValuesFailed

        staged_at = time.perf_counter()
        # the staged copy can be the allocation that fails (a group larger than the ring goes
        # through a fresh device buffer): it gets the same message as the decoded buffer's
        try:
            fixed, words, starts = self.staging.stage_group(planes, check)
            self.copy_seconds += time.perf_counter() - staged_at
            out = _device_empty((len(jobs), rows, cols), self.device)
        except torch.OutOfMemoryError:
            raise DeviceMemoryError(self._oom_message(planes, rows, cols, first.what)) from None
        most = max(plane.exceptions.numel() for plane in planes)
        wait_triton_start()  # (counted apart from the launches: describe_triton_start)
        launched_at = time.perf_counter()
        decode_triton_stacked(fixed, words, starts, codec, len(jobs), rows, cols, out, most)
        launch = time.perf_counter() - launched_at
        self.launch_seconds += launch
        if (codec.name, rows, cols) not in self.launched_shapes:
            self.launched_shapes.add((codec.name, rows, cols))
            self.first_launch_seconds += launch
        self.launches += 1
        self.planes += len(jobs)
        self.decoded_bytes += out.numel()
        return list(out.unbind(0))

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
            wait_triton_start()
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

    def _oom_message(self, plane: CsfPlane | Sequence[CsfPlane], rows: int, cols: int, what: str) -> str:
        planes = [plane] if isinstance(plane, CsfPlane) else list(plane)
        fixed = sum(p.fixed.numel() for p in planes)
        words = 4 * sum(p.exceptions.numel() for p in planes)
        decoded = len(planes) * rows * cols
        needed = fixed + words + decoded
        free = ""
        if self.device.type == "cuda":
            try:
                available, total = torch.cuda.mem_get_info(self.device)
                free = f"; {available:,} of {total:,} bytes free on {self.device}"
            except RuntimeError:  # pragma: no cover - the device is gone
                pass
        together = f" and the {len(planes) - 1} same-shape planes decoded with it" if len(planes) > 1 else ""
        shape = f"[{rows}, {cols}]" if len(planes) == 1 else f"{len(planes)} x [{rows}, {cols}]"
        return (
            f"{what}: out of memory on {self.device} decoding this scale plane{together}: it needs {needed:,} bytes "
            f"there (compressed stream {fixed:,} + exception words {words:,} + decoded {shape} {decoded:,})"
            f"{free}. Free device memory (lower --gpu-memory-utilization's share taken before loading, or use a "
            f"larger tensor-parallel size)"
        )


def _stage_pageable(
    planes: Sequence[CsfPlane], device: torch.device, check: Callable[[torch.Tensor], None] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The group's buffer filled in fresh pageable memory (``check`` sees it first) and copied to
    ``device``, the copy waited for: the way of a group larger than the staging ring."""
    host = torch.empty(_group_layout(planes)[2], dtype=torch.uint8)
    _fill_staging(host, planes)
    if check is not None:
        check(host)
    return _staged_views(_device_empty((host.numel(),), device).copy_(host), planes)


def stage_plane(plane: CsfPlane, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A host plane's fixed stream, exception words and ``[0, count]`` word starts on ``device``, in
    one copy from pageable memory: one buffer (``_group_layout``) carries what would otherwise be
    three copies."""
    fixed, words, starts = _stage_pageable([plane], device)
    return fixed.view(plane.fixed.shape), words, starts


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
