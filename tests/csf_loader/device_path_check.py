"""The ``csf`` load format's device decode path against its host path, good and bad input.

    python tests/csf_loader/device_path_check.py cpu    # under TRITON_INTERPRET=1: the Triton kernel on CPU tensors
    python tests/csf_loader/device_path_check.py cuda   # on a GPU: the Triton kernel on the device

Streams the same checkpoints through ``stream.decode_csf_stream`` / ``stream.mxfp4_container_stream``
twice: with the host decoder (the torch codec, as on CPU) and with the device decoder
(``PlaneDecoder`` with the Triton kernel on DEVICE; on cpu it is forced with ``kernel="triton"``,
the CPU standing in for the GPU). Checks:

* every yielded tensor has the same name, dtype, shape and bytes, the decoded ones on DEVICE;
* a host plane staged for the device (``device_decode.stage_plane``: starts, exception words and
  fixed stream in one buffer; ``StagingRing``: the same through a reused, on CUDA pinned, ring)
  decodes to the torch codec's bytes, with and without exception words, through the one-pass
  kernel and the fallback, for both codecs, the ring wrapping and a plane larger than it;
* planes taken in groups (a window of planes held back, then checked, copied and decoded per
  shape at once) come out in stream order with the same bytes, in fewer launches than planes,
  and of two corrupt planes the first in stream order is named;
* every corrupt-input case fails with the same ``CsfLoadError`` message on both paths, naming the
  file (or shard) and tensor;
* the stream run on a thread ahead of its consumer (``read_ahead``, as the loader does with the
  Triton kernel and ``CSF_LOADER_READ_AHEAD=1``) gives the same tensors in order and the same errors
  (on cuda with the consumer on a stream of its own);
* an out-of-memory error while decoding names the tensor and the bytes it needed (on cpu the
  allocation is made to fail; on cuda the process's memory is really capped).

Prints one summary line; exits non-zero on any failure.
"""

from __future__ import annotations

import math
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from csf_loader import device_decode
from csf_loader.codec import MXFP4_CSF, NVFP4_CSF, CsfCodec, decode, encode
from csf_loader.convert import main as csf_convert
from csf_loader.device_decode import PlaneDecoder, StagingRing, stage_plane
from csf_loader.read_ahead import read_ahead
from csf_loader.stream import CsfLoadError, decode_csf_stream, mxfp4_container_stream
from csf_loader.triton_decode import TRITON_START, decode_triton_stacked, describe_triton_start, prefetch_triton_start

Stream = list[tuple[str, torch.Tensor]]
FAILURES: list[str] = []
CHECKED = [0]


def check(ok: bool, what: str) -> None:
    CHECKED[0] += 1
    if not ok:
        FAILURES.append(what)
        print(f"FAIL {what}", flush=True)


def scales(seed: int, rows: int, cols: int, spread: int = 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centre = torch.randint(60, 180, (rows, 1), generator=g)
    return (centre + torch.randint(-spread, spread + 1, (rows, cols), generator=g)).clamp(0, 255).to(torch.uint8)


def pair(name: str, plane_scales: torch.Tensor) -> Stream:
    plane = encode(plane_scales, NVFP4_CSF)
    return [(name + NVFP4_CSF.fixed_suffix, plane.fixed), (name + NVFP4_CSF.exceptions_suffix, plane.exceptions)]


def nvfp4_stream() -> tuple[Stream, dict[str, str]]:
    """Planes of several geometries (one-pass kernel, fallback, several programs, no exceptions),
    ordinary tensors between them and a pair whose partner arrives later."""
    a = pair("model.layers.0.mlp.experts.0.down_proj.weight_scale", scales(1, 64, 8))
    b = pair("model.layers.0.self_attn.o_proj.weight_scale", scales(2, 48, 6))  # cols % 8 != 0: fallback
    c = pair("model.layers.1.mlp.experts.1.up_proj.weight_scale", scales(3, 160, 24, spread=40))
    d = pair("model.layers.1.mlp.shared_expert.up_proj.weight_scale", torch.full((32, 16), 0x38, dtype=torch.uint8))
    stream = [
        ("model.embed_tokens.weight", torch.randn(8, 4).to(torch.bfloat16)),
        a[0],
        *b,
        ("model.layers.0.input_layernorm.weight", torch.randn(4)),
        a[1],
        c[1],
        *d,
        c[0],
    ]
    return stream, dict.fromkeys([n for n, _ in stream], "model-00001-of-00001.safetensors")


def consume(stream: Iterable[tuple[str, torch.Tensor]]) -> Stream:
    return [(name, tensor) for name, tensor in stream]


def same(host: Stream, dev: Stream, device: torch.device, label: str) -> None:
    check([n for n, _ in host] == [n for n, _ in dev], f"{label}: names differ")
    for (name, h), (_, d) in zip(host, dev, strict=False):
        ok = h.dtype == d.dtype and h.shape == d.shape
        ok = ok and torch.equal(h.contiguous().view(torch.uint8).cpu(), d.contiguous().view(torch.uint8).cpu())
        check(ok, f"{label}: {name} differs ({h.dtype} {list(h.shape)} vs {d.dtype} {list(d.shape)})")
        if name.endswith(("weight_scale", "scale", "scales")) and h.element_size() == 1:
            # "cuda" names the current CUDA device: a plane decoded on cuda:0 is on it
            here = d.device.type == device.type and device.index in (None, d.device.index)
            check(here, f"{label}: {name} decoded on {d.device}, not {device}")


def error_of(run: Callable[[], object]) -> str:
    try:
        run()
    except CsfLoadError as exc:
        return str(exc)
    return "<no error>"


def corrupt_cases(stream: Stream) -> Iterator[tuple[str, Stream, str]]:
    """(label, corrupt stream, text the error must contain)."""
    name = "model.layers.0.mlp.experts.0.down_proj.weight_scale"
    fixed_name, exc_name = name + NVFP4_CSF.fixed_suffix, name + NVFP4_CSF.exceptions_suffix
    tensors = dict(stream)

    def changed(fixed: torch.Tensor | None = None, exceptions: torch.Tensor | None = None) -> Stream:
        out = []
        for n, t in stream:
            if n == fixed_name and fixed is not None:
                t = fixed
            elif n == exc_name and exceptions is not None:
                t = exceptions
            out.append((n, t))
        return out

    bad = tensors[fixed_name].clone()
    bad[1, 2] = 241  # base of row 18
    yield "base above 240", changed(fixed=bad), f"{fixed_name}: row 18 has base 241 above"
    words = tensors[exc_name]
    outside = torch.cat([words, torch.tensor([64 * 8 | (7 << 24)], dtype=torch.uint32)])
    yield "exception outside the plane", changed(exceptions=outside), f"{exc_name}: exception position 512 lies outside"
    swapped = torch.tensor([5 | (1 << 24), 3 | (1 << 24)], dtype=torch.uint32)
    yield "unsorted exceptions", changed(exceptions=swapped), f"{exc_name}: exception positions are not strictly"
    yield "exceptions int64", changed(exceptions=words.to(torch.int64)), "dtype torch.int64, expected torch.uint32"
    yield "fixed int32", changed(fixed=tensors[fixed_name].to(torch.int32)), "dtype torch.int32, expected torch.uint8"
    yield "fixed not slab-shaped", changed(fixed=tensors[fixed_name][:, :20]), f"{fixed_name}: shape [4, 20] is not"
    missing = [(n, t) for n, t in stream if n != exc_name]
    yield "no partner", missing, f"{fixed_name} has no partner {exc_name}"


def oom_message(device: torch.device, plane_stream: Stream) -> str:
    """The error when the device runs out of memory decoding the plane: on cuda with the process's
    memory capped (the staged copy's allocation fails first), on cpu by failing the first device
    allocation, the staged copy's, then, in a second decode, the decoded plane's."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        budget = torch.cuda.memory_reserved(device) + (1 << 20)
        torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.get_device_properties(device).total_memory)
        try:
            return error_of(lambda: consume(decode_csf_stream(plane_stream, decoder=PlaneDecoder(device))))
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
            torch.cuda.empty_cache()
    real = device_decode._device_empty

    def message_when(failing: str) -> str:
        def fail(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
            if failing == "decoded" and len(shape) == 1:  # the staged copy (one dimension) succeeds
                return real(shape, device)
            raise torch.OutOfMemoryError(f"out of memory: tried to allocate {math.prod(shape)} bytes")

        device_decode._device_empty = fail
        decoder = PlaneDecoder(device, "triton")
        try:
            return error_of(lambda: consume(decode_csf_stream(plane_stream, decoder=decoder)))
        finally:
            device_decode._device_empty = real

    staged, decoded = message_when("staged"), message_when("decoded")
    check(staged == decoded, f"out of memory staging {staged!r} vs decoding {decoded!r}")
    return decoded


def staged_planes(device: torch.device) -> None:
    """Host planes staged for the device decode by the kernel to the codec's bytes: one buffer a
    plane (``stage_plane``), and the staging ring (``StagingRing``) small enough that it wraps and
    that one plane crosses alone, every decoded plane checked again after the last one."""
    cases: list[tuple[CsfCodec, int, int, int]] = [
        (NVFP4_CSF, 32, 64, 20),  # exception words, one-pass kernel
        (NVFP4_CSF, 48, 32, 3),  # no exception words: the starts stand in for the words pointer
        (MXFP4_CSF, 32, 40, 2),  # exception words, one-pass kernel
        (MXFP4_CSF, 16, 12, 0),  # no exception words, columns not a multiple of 8: the fallback
        (NVFP4_CSF, 128, 64, 20),  # larger than the ring below: crosses alone
        (NVFP4_CSF, 16, 16, 20),
    ]
    ring = StagingRing(device, capacity=4096)
    decoded: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for seed, (codec, rows, cols, spread) in enumerate(cases):
        plane = encode(scales(seed, rows, cols, spread), codec)
        expected = decode(plane, codec, rows, cols)
        label = f"staged {codec.family} [{rows}, {cols}] with {plane.exceptions.numel()} exception words"
        for how, stage in (
            ("one buffer", lambda p=plane: stage_plane(p, device)),
            ("ring", lambda p=plane: ring.stage(p)),
        ):
            fixed, words, starts = stage()
            check(fixed.device.type == device.type and fixed.data_ptr() % 4 == 0, f"{label} ({how}): fixed misplaced")
            check(starts.cpu().tolist() == [0, plane.exceptions.numel()], f"{label} ({how}): starts {starts.tolist()}")
            out = torch.empty(rows, cols, dtype=torch.uint8, device=device)
            decode_triton_stacked(fixed, words, starts, codec, 1, rows, cols, out, words.numel())
            decoded.append((f"{label} ({how})", out, expected))
    check(ring.waits >= 1, f"the staging ring never wrapped ({ring.offset} bytes used)")
    for label, out, expected in decoded:
        check(torch.equal(out.cpu(), expected), f"{label}: decoded bytes differ")


def expert_planes(count: int, proj: str, seed: int) -> tuple[Stream, dict[str, str]]:
    """``count`` experts' scale planes of two shapes, each followed by an ordinary tensor, in one shard."""
    stream: Stream = []
    for i in range(count):
        rows, cols = (32, 16) if i % 3 else (16, 64)
        stream += pair(f"model.layers.{i}.mlp.experts.{i}.{proj}.weight_scale", scales(seed + i, rows, cols))
        stream.append((f"model.layers.{i}.mlp.experts.{i}.{proj}.weight", torch.randn(64, 8)))
    return stream, dict.fromkeys([n for n, _ in stream], "model-00001-of-00001.safetensors")


def with_bad_bases(stream: Stream, layers: tuple[int, ...], proj: str) -> Stream:
    """``stream`` with a base of 250 (above NVFP4-CSF's 240) in the planes of ``layers``."""
    bad = dict(stream)
    for i in layers:
        name = f"model.layers.{i}.mlp.experts.{i}.{proj}.weight_scale{NVFP4_CSF.fixed_suffix}"
        fixed = bad[name].clone()
        fixed[0, 1] = 250
        bad[name] = fixed
    return list(bad.items())


def host_decoded(stream: Stream, shard_of: dict[str, str]) -> Stream:
    return consume(decode_csf_stream(stream, shard_of, decoder=PlaneDecoder(torch.device("cpu"), "torch")))


def batched_windows(device: torch.device, kernel: str) -> None:
    """The device decoder takes planes in groups (``PlaneWindow``, ``decode_many``): a stream of
    many planes of two shapes between ordinary tensors, windows small enough to flush mid-stream
    on the plane count and on the held bytes, comes out in the host path's order with its bytes,
    in fewer launches than planes; with two corrupt planes of different shapes, the error names
    the first in stream order, as the host path's does."""
    stream, shard_of = expert_planes(10, "gate_proj", 20)
    host = host_decoded(stream, shard_of)
    # the second half of the stream in another shard: the window is emptied at the boundary
    two_shards = {n: f"model-0000{1 + (k >= len(stream) // 2)}-of-00002.safetensors" for k, (n, _) in enumerate(stream)}
    for planes, held, shards in ((4, 1 << 30, shard_of), (128, 8000, shard_of), (128, 1 << 30, shard_of),
                                 (128, 1 << 30, two_shards)):  # fmt: skip
        label = f"window {planes}/{held}, {len(set(shards.values()))} shard(s)"
        decoder = PlaneDecoder(device, kernel, batch_planes=planes, batch_bytes=held)
        check(decoder.batches, f"the device decoder ({decoder.kernel}) does not take planes in groups")
        same(host, consume(decode_csf_stream(stream, shards, decoder=decoder)), device, label)
        check(
            decoder.planes == 10 and 2 <= decoder.launches < 10,
            f"{label}: {decoder.planes} planes in {decoder.launches} launches",
        )
    corrupt = with_bad_bases(stream, (4, 6), "gate_proj")  # shapes (32, 16) and (16, 64): plane 4 comes first
    host_error = error_of(lambda: host_decoded(corrupt, shard_of))
    on_device = error_of(lambda: consume(decode_csf_stream(corrupt, shard_of, decoder=PlaneDecoder(device, kernel))))
    message = f"two bad planes: host {host_error!r}, device {on_device!r}"
    check(host_error == on_device and "layers.4." in on_device, message)


def read_ahead_paths(device: torch.device, kernel: str) -> None:
    """With ``CSF_LOADER_READ_AHEAD=1`` the loader's device path runs the stream on a thread ahead of
    stock's copies (``read_ahead``):
    the same tensors in the same order as the host path, a window of planes flushing while the consumer
    lags two items behind, and a corrupt plane's error, the same message, after the tensors before it.
    On CUDA the consumer iterates on a stream of its own, which the worker's copies and launches follow."""
    stream, shard_of = expert_planes(12, "up_proj", 60)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def ahead(items: Stream) -> Stream:
        decoder = PlaneDecoder(device, kernel, batch_planes=5)
        produced = read_ahead(decode_csf_stream(items, shard_of, decoder=decoder), device, max_items=2)
        if side is None:
            return consume(produced)
        with torch.cuda.stream(side):  # copied on the consumer's stream, as stock's weight loader does
            copies = [(n, t.clone()) for n, t in produced]
        side.synchronize()
        return copies

    same(host_decoded(stream, shard_of), ahead(stream), device, "read ahead")
    corrupt = with_bad_bases(stream, (7,), "up_proj")
    host_error = error_of(lambda: host_decoded(corrupt, shard_of))
    check(
        host_error == error_of(lambda: ahead(corrupt)) and "layers.7." in host_error,
        f"read ahead, bad plane: {host_error!r}",
    )


def main() -> int:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    kernel = "triton" if device.type == "cpu" else ""  # on cpu the Triton kernel stands in for the GPU's

    def host() -> PlaneDecoder:
        return PlaneDecoder(torch.device("cpu"), "torch")

    def dev() -> PlaneDecoder:
        decoder = PlaneDecoder(device, kernel)
        check(decoder.kernel == "triton", f"the device decoder runs {decoder.kernel}, not the Triton kernel")
        return decoder

    # as the loader does on CUDA: Triton's start on a helper thread, which the first launch joins
    check(prefetch_triton_start() and prefetch_triton_start(), "Triton's start was not begun")
    helper = TRITON_START.thread
    stream, shard_of = nvfp4_stream()
    same(
        consume(decode_csf_stream(stream, shard_of, decoder=host())),
        consume(decode_csf_stream(stream, shard_of, decoder=dev())),
        device,
        "NVFP4 stream",
    )
    check(
        helper is TRITON_START.thread and helper is not None and not helper.is_alive(),
        "the first launch did not join Triton's start (or a second one was begun)",
    )
    check(
        TRITON_START.seconds is not None and "ran beside the load" in describe_triton_start(),
        f"Triton's start: {TRITON_START}",
    )
    staged_planes(device)
    batched_windows(device, kernel)
    read_ahead_paths(device, kernel)
    # A rank's extent: the host path decodes only that region, the device path the whole plane.
    region = ((16, 48), (2, 6))
    host_decoder, dev_decoder = host(), dev()
    part = consume(decode_csf_stream(stream[1:2] + stream[5:6], extent_of=lambda *_: region, decoder=host_decoder))
    whole = consume(decode_csf_stream(stream[1:2] + stream[5:6], extent_of=lambda *_: region, decoder=dev_decoder))
    check(host_decoder.partial == 1 and dev_decoder.partial == 0, "extent: host decodes the region, device the plane")
    (r0, r1), (c0, c1) = region
    check(
        torch.equal(part[0][1].view(torch.uint8)[r0:r1, c0:c1], whole[0][1].view(torch.uint8).cpu()[r0:r1, c0:c1]),
        "extent: the rank's region differs",
    )
    for label, bad, expected in corrupt_cases(stream):
        on_host = error_of(lambda bad=bad: consume(decode_csf_stream(bad, shard_of, decoder=host())))
        on_device = error_of(lambda bad=bad: consume(decode_csf_stream(bad, shard_of, decoder=dev())))
        check(on_host == on_device, f"{label}: host says {on_host!r}, device says {on_device!r}")
        check(expected in on_device and "model-00001-of-00001.safetensors" in on_device, f"{label}: {on_device!r}")

    with tempfile.TemporaryDirectory() as tmp:
        from tests.csf_loader.toy_checkpoints import make_mxfp4_moe

        src = make_mxfp4_moe(Path(tmp) / "src")
        csf = Path(tmp) / "csf"
        assert csf_convert(["encode", str(src), str(csf), "--quiet"]) == 0
        same(
            consume(mxfp4_container_stream(csf, host())),
            consume(mxfp4_container_stream(csf, dev())),
            device,
            "MXFP4 container",
        )
        same(
            consume(mxfp4_container_stream(csf, host())),
            consume(read_ahead(mxfp4_container_stream(csf, dev()), device, max_items=1)),
            device,
            "MXFP4 container read ahead",
        )
        # A corrupt MXFP4 stream: a base above 254 in one expert's plane.
        from safetensors.torch import load_file, save_file

        shard = csf / "tensors" / "model.safetensors"
        tensors = load_file(str(shard))
        name = "model.layers.1.mlp.experts.0.w1.scale"
        fixed = tensors[name + MXFP4_CSF.fixed_suffix].clone()
        fixed[3] = 255
        tensors[name + MXFP4_CSF.fixed_suffix] = fixed
        save_file(tensors, str(shard), metadata={"schema": "lil-mxfp4-csf-checkpoint/1", "codec": MXFP4_CSF.name})
        on_host = error_of(lambda: consume(mxfp4_container_stream(csf, host())))
        on_device = error_of(lambda: consume(mxfp4_container_stream(csf, dev())))
        check(on_host == on_device, f"MXFP4 base above 254: host {on_host!r}, device {on_device!r}")
        check(f"tensors/model.safetensors: {name}.mxfp4_csf_fixed: row 3 has base 255" in on_device, on_device)

    big = pair("model.layers.2.mlp.experts.3.gate_proj.weight_scale", scales(4, 4096, 4096))
    message = oom_message(device, big)
    check(
        "model.layers.2.mlp.experts.3.gate_proj.weight_scale: out of memory on" in message
        and f"decoded [4096, 4096] {4096 * 4096:,}" in message,
        f"out of memory: {message!r}",
    )
    print(f"device={device} checks={CHECKED[0]} failures={len(FAILURES)}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
