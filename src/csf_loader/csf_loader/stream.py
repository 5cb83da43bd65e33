"""The ``csf`` load format's weight streams, without vLLM: CSF planes decoded as they stream in.

``decode_csf_stream`` turns a checkpoint's (name, tensor) stream with NVFP4-CSF pairs into the
source checkpoint's stream (each pair decoded into its E4M3 ``<name>``); ``mxfp4_container_stream``
reads an MXFP4-CSF container as the source MXFP4 checkpoint's stream. Each plane is decoded by a
``device_decode.PlaneDecoder`` on the device the weights go to (the Triton kernel on CUDA, a
window of planes at a time through ``PlaneWindow``, the stream's order kept; the torch codec on
the host, plane by plane). ``preflight`` checks a checkpoint's files before any tensor is read.
Every error is a ``CsfLoadError`` naming the file and tensor. ``csf_loader.vllm_loader`` plugs
these into stock vLLM's loader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path

import torch

from csf_loader.codec import MXFP4_CSF, NVFP4_CSF, CsfCodec, CsfFormatError, CsfPlane, nvfp4_plane_shape
from csf_loader.device_decode import DeviceMemoryError, PlaneDecoder, PlaneJob
from csf_loader.layout import Container, is_mxfp4_container, logical_2d, read_container, read_index
from csf_loader.preflight import check_mxfp4_container, check_nvfp4_checkpoint
from csf_loader.safetensors_io import TORCH_DTYPE, CheckpointError
from csf_loader.triton_decode import describe_triton_start

logger = logging.getLogger("vllm.plugins.csf_loader")

FIXED, EXCEPTIONS = NVFP4_CSF.fixed_suffix, NVFP4_CSF.exceptions_suffix


class CsfLoadError(ValueError):
    """A CSF checkpoint cannot be loaded; the message names the tensor and file."""


def nvfp4_logical_shape(fixed: torch.Tensor, where: str) -> tuple[int, int]:
    plane = nvfp4_plane_shape(tuple(fixed.shape))
    if plane is None:
        raise CsfLoadError(f"{where}{FIXED}: shape {list(fixed.shape)} is not [rows / 16, 16 * (1 + cols / 2)]")
    return plane


Extent = tuple[tuple[int, int], tuple[int, int]]


def decode_plane(
    decoder: PlaneDecoder,
    plane: CsfPlane,
    codec: CsfCodec,
    rows: int,
    cols: int,
    what: str,
    region: Extent | None = None,
) -> torch.Tensor:
    """``decoder.decode`` with its errors as startup errors naming ``what`` (file and tensor)."""
    try:
        return decoder.decode(plane, codec, rows, cols, what, region)
    except (CsfFormatError, DeviceMemoryError) as exc:
        raise CsfLoadError(str(exc)) from None


class PlaneWindow:
    """A weight stream's order kept while its planes wait to be decoded in groups.

    With a decoder that ``batches`` (the Triton kernel), a completed plane becomes a job and
    the tensors after it are held back until ``batch_planes`` jobs are waiting or ``batch_bytes``
    are held (tensors and compressed planes); then every job is decoded at once
    (``PlaneDecoder.decode_many``) and the held entries come out in stream order. While no job
    waits, tensors pass straight through.
    """

    def __init__(self, decoder: PlaneDecoder) -> None:
        self.decoder = decoder
        self.entries: list[tuple[str, torch.Tensor | None, Callable[[torch.Tensor], torch.Tensor] | None]] = []
        self.jobs: list[PlaneJob] = []
        self.held_bytes = 0

    def tensor(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.jobs:
            yield name, tensor
            return
        self.entries.append((name, tensor, None))
        self.held_bytes += tensor.numel() * tensor.element_size()
        if self.held_bytes >= self.decoder.batch_bytes:
            yield from self.flush()

    def plane(
        self, name: str, job: PlaneJob, finish: Callable[[torch.Tensor], torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``finish`` turns the decoded ``[rows, cols]`` uint8 plane into the tensor to yield."""
        self.entries.append((name, None, finish))
        self.jobs.append(job)
        # the planes' own bytes count too, so a window of large planes stays small on both sides
        self.held_bytes += job.plane.fixed.numel() + 4 * job.plane.exceptions.numel()
        if len(self.jobs) >= self.decoder.batch_planes or self.held_bytes >= self.decoder.batch_bytes:
            yield from self.flush()

    def flush(self) -> Iterator[tuple[str, torch.Tensor]]:
        entries, jobs = self.entries, self.jobs
        self.entries, self.jobs, self.held_bytes = [], [], 0
        if not jobs:
            yield from ((name, t) for name, t, _ in entries if t is not None)
            return
        try:
            decoded = iter(self.decoder.decode_many(jobs))
        except (CsfFormatError, DeviceMemoryError) as exc:
            raise CsfLoadError(str(exc)) from None
        for name, tensor, finish in entries:
            if finish is None:
                assert tensor is not None
                yield name, tensor
            else:
                yield name, finish(next(decoded))


def as_e4m3(scales: torch.Tensor) -> torch.Tensor:
    return scales.view(torch.float8_e4m3fn)


def decode_csf_stream(
    weights: Iterable[tuple[str, torch.Tensor]],
    shard_of: dict[str, str] | None = None,
    extent_of: Callable[[str, int, int], Extent | None] | None = None,
    decoder: PlaneDecoder | None = None,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Replace every NVFP4-CSF pair in a weight stream by its decoded E4M3 tensor.

    Each plane is decoded by ``decoder`` (default: the torch codec on the host) as soon as both
    of its streams have arrived, and yielded on the decoder's device. With ``extent_of(name,
    rows, cols)`` returning this rank's ``((r0, r1), (c0, c1))``, the torch codec decodes only
    that region from the compressed payload (the slabs and code bytes it covers), placed in a
    full-shape tensor whose other bytes stock's weight loader never reads, since it narrows to
    exactly that region.
    """
    shard_of = shard_of or {}
    decoder = decoder or PlaneDecoder(torch.device("cpu"))
    window = PlaneWindow(decoder)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    shard = None
    for name, tensor in weights:
        if shard_of.get(name, shard) != shard:
            # nothing read from a shard is held past it (its file may be closed and unmapped then)
            yield from window.flush()
            shard = shard_of.get(name)
        suffix = FIXED if name.endswith(FIXED) else EXCEPTIONS if name.endswith(EXCEPTIONS) else None
        if suffix is None:
            yield from window.tensor(name, tensor)
            continue
        base = name[: -len(suffix)]
        parts = pending.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) < 2:
            continue
        del pending[base]
        where = f"{shard_of.get(name, '?')}: {base}"
        rows, cols = nvfp4_logical_shape(parts[FIXED], where)
        plane = CsfPlane(parts[FIXED], parts[EXCEPTIONS])
        if decoder.batches:
            yield from window.plane(base, PlaneJob(plane, NVFP4_CSF, rows, cols, where), as_e4m3)
            continue
        extent = extent_of(base, rows, cols) if extent_of is not None and decoder.on_host else None
        scales = decode_plane(decoder, plane, NVFP4_CSF, rows, cols, where, extent)
        yield base, as_e4m3(scales)
    yield from window.flush()
    if pending:
        base, parts = next(iter(pending.items()))
        present = next(iter(parts))
        missing = FIXED if present == EXCEPTIONS else EXCEPTIONS
        raise CsfLoadError(
            f"{shard_of.get(base + present, '?')}: {base}{present} has no partner {base}{missing} "
            f"({len(pending)} unpaired CSF stream(s))"
        )
    log_decoded(decoder, "NVFP4-CSF")


def log_decoded(decoder: PlaneDecoder, family: str) -> None:
    if decoder.planes:
        launches = (
            f", {decoder.launches} launches ({decoder.launch_seconds:.3f} s in the launch calls, "
            f"{decoder.first_launch_seconds:.3f} s of it the first of each of {len(decoder.launched_shapes)} shapes)"
            if decoder.launches
            else ""
        )
        staging = (
            f", {decoder.copy_seconds:.3f} s of it staging the planes for the device" if decoder.copy_seconds else ""
        )
        logger.info(
            "csf_loader: decoded %d %s scale planes %s (%d of them only this rank's TP extent, %.1f MB) "
            "in %.3f s%s%s%s",
            decoder.planes,
            family,
            decoder.describe(),
            decoder.partial,
            decoder.decoded_bytes / 1e6,
            decoder.seconds,
            launches,
            staging,
            describe_triton_start() if decoder.launches else "",
        )


def shard_index(model_dir: str) -> dict[str, str]:
    """tensor -> shard from the index (empty for a hub id or a checkpoint without an index)."""
    root = Path(model_dir)
    if not root.is_dir():
        return {}
    try:
        return read_index(root) or {}
    except CheckpointError as exc:
        raise CsfLoadError(str(exc)) from None


def csf_planes(model_dir: str) -> dict[str, str]:
    """Scale names stored as CSF pairs (from the index), with their shard."""
    return {n[: -len(FIXED)]: s for n, s in shard_index(model_dir).items() if n.endswith(FIXED)}


def read_mxfp4_contract(root: Path) -> Container:
    """``layout.read_container``, its errors as startup errors of the load format."""
    try:
        return read_container(root)
    except CheckpointError as exc:
        raise CsfLoadError(str(exc)) from None


def mxfp4_container_stream(
    root: Path, decoder: PlaneDecoder | None = None
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Source-named tensors of an MXFP4-CSF container, compressed scales decoded by ``decoder``
    (default: the torch codec on the host) to their receipt's shape and dtype, on its device."""
    from safetensors import safe_open

    decoder = decoder or PlaneDecoder(torch.device("cpu"))
    window = PlaneWindow(decoder)
    container = read_mxfp4_contract(root)
    fixed_sfx, exc_sfx = MXFP4_CSF.fixed_suffix, MXFP4_CSF.exceptions_suffix
    for shard in container.shards:
        path = container.tensor_dir / shard
        compressed = container.compressed(shard)
        with safe_open(str(path), "pt") as f:
            names = list(f.keys())
            present = set(names)
            for name in names:
                if name.endswith(exc_sfx):
                    continue
                if not name.endswith(fixed_sfx):
                    if name in compressed:
                        raise CsfLoadError(f"{path}: {name} is stored uncompressed but its receipt says compressed")
                    yield from window.tensor(name, f.get_tensor(name))
                    continue
                base = name[: -len(fixed_sfx)]
                if base + exc_sfx not in present:
                    raise CsfLoadError(f"{path}: {name} has no partner {base}{exc_sfx}")
                if base not in compressed:
                    raise CsfLoadError(f"{path}: {base} is compressed but has no receipt entry (shape unknown)")
                shape = tuple(compressed[base]["shape"])
                rows, cols = logical_2d(shape)
                plane = CsfPlane(f.get_tensor(name), f.get_tensor(base + exc_sfx))
                dtype = compressed[base].get("dtype", "U8")
                if dtype not in TORCH_DTYPE or TORCH_DTYPE[dtype].itemsize != 1:
                    raise CsfLoadError(f"{path}: {base}: its receipt's dtype {dtype!r} is not a 1-byte scale dtype")

                def finish(scales: torch.Tensor, shape: tuple[int, ...] = shape, dtype: str = dtype) -> torch.Tensor:
                    return scales.reshape(shape).view(TORCH_DTYPE[dtype])

                what = f"{path}: {base}"
                if decoder.batches:
                    yield from window.plane(base, PlaneJob(plane, MXFP4_CSF, rows, cols, what), finish)
                else:
                    yield base, finish(decode_plane(decoder, plane, MXFP4_CSF, rows, cols, what))
            for name in present:
                if name.endswith(exc_sfx) and name[: -len(exc_sfx)] + fixed_sfx not in present:
                    raise CsfLoadError(f"{path}: {name} has no partner {name[: -len(exc_sfx)]}{fixed_sfx}")
            yield from window.flush()  # nothing of a shard is held past its file's closing
    log_decoded(decoder, "MXFP4-CSF")


def preflight(model: str) -> None:
    """Check a local checkpoint's files (headers only) before stock reads any tensor.

    Missing or truncated shards, corrupt headers, CSF streams with the wrong dtype, shape
    or no partner, and scales that do not fit their weights fail here, naming the file and
    tensor (``csf_loader.preflight``). A hub model id is resolved by stock later; its
    files get the checks of the weight stream only.
    """
    root = Path(model)
    if not root.is_dir():
        return
    try:
        if is_mxfp4_container(model):
            check_mxfp4_container(read_mxfp4_contract(root))
        else:
            check_nvfp4_checkpoint(root)
    except CheckpointError as exc:
        raise CsfLoadError(str(exc)) from None
