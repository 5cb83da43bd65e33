"""`csf-convert`: standard NVFP4 / MXFP4 safetensors checkpoints to CSF and back (no vLLM).

    csf-convert encode SRC DST [--codec nvfp4|mxfp4] [--scope experts|all] [--force]
    csf-convert decode CSF DST [--force]
    csf-convert verify CSF [--source SRC]

encode
  NVFP4 (ModelOpt): every selected E4M3 ``<name>`` (``*.weight_scale``) becomes
  ``<name>.nvfp4_csf_fixed`` + ``<name>.nvfp4_csf_exceptions`` in the same shard,
  the index maps both, and ``quantization_config`` becomes ModelOpt
  ``MIXED_PRECISION`` whose recipes for the compressed modules carry
  ``"weight_scale_encoding": "csf"``. Everything else is byte-identical.
  MXFP4: a ``lil-mxfp4-csf-checkpoint/1`` container: ``tensors/<shard>`` (shard
  metadata ``schema`` and ``codec``), ``manifest.json``, ``build-contract.json``,
  ``receipts/<shard>.json``; no top-level index.
  Both keep, per shard, a receipt with the exact source header and SHA-256, so
  ``decode`` rebuilds the source shards bit for bit (NVFP4 receipts live in
  ``csf-receipts/``; loaders ignore them).
verify
  decodes every plane and checks that the rebuilt source shards hash to the
  receipts' SHA-256 (and, with ``--source``, to the files there).

Output is written to a temporary sibling directory and renamed into place only
when complete; on an error or SIGINT/SIGTERM the temporary directory is removed, and
one left by SIGKILL is removed by the next run. DST never holds a partial checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from csf_loader.codec import MXFP4_CSF, NVFP4_CSF, CsfCodec, CsfFormatError, CsfPlane, decode, encode
from csf_loader.layout import (
    BUILD_CONTRACT,
    INDEX,
    MANIFEST,
    MXFP4_RECEIPTS,
    MXFP4_SCHEMA,
    MXFP4_TENSORS,
    NVFP4_RECEIPTS,
    SOURCE_FILES,
    experts_module,
    is_mxfp4_container,
    is_routed_expert,
    layer_of,
    logical_2d,
    read_container,
    read_receipts,
    shard_names,
)
from csf_loader.preflight import check_source_scales
from csf_loader.safetensors_io import (
    CheckpointError,
    ShardReader,
    TensorEntry,
    layout_header,
    tensor_bytes,
    write_shard,
)

CHUNK = 16 * 1024 * 1024


class ConvertError(RuntimeError):
    """A conversion cannot proceed; the message says which file / tensor and why."""


# ----------------------------------------------------------------------------- config


def quant_holder(config: dict[str, Any]) -> dict[str, Any]:
    """The dict that holds ``quantization_config`` (top level or ``text_config``)."""
    if isinstance(config.get("quantization_config"), dict):
        return config
    text = config.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("quantization_config"), dict):
        return text
    raise ConvertError("config.json has no quantization_config: not an NVFP4 or MXFP4 checkpoint")


def detect_codec(config: dict[str, Any]) -> CsfCodec:
    qc = quant_holder(config)["quantization_config"]
    method = str(qc.get("quant_method", "")).lower()
    algo = str(qc.get("quant_algo", "")).upper()
    if method == "modelopt" and algo == "NVFP4":
        return NVFP4_CSF
    if method == "modelopt" and algo == "MIXED_PRECISION":
        recipes = qc.get("quantized_layers", {})
        if any(str(r.get("quant_algo", "")).upper() == "NVFP4" for r in recipes.values()):
            return NVFP4_CSF
    if method == "mxfp4":
        return MXFP4_CSF
    raise ConvertError(f"unsupported quantization_config (quant_method={method!r}, quant_algo={algo!r})")


def module_of(scale_name: str) -> str:
    return scale_name.rsplit(".", 1)[0]


def recipe_key(module: str) -> str:
    """Routed experts get one recipe for the whole ``...experts`` module, as published."""
    return experts_module(module) or module


def csf_quant_config(source: dict[str, Any], compressed_scales: list[str], all_scales: list[str]) -> dict[str, Any]:
    """ModelOpt MIXED_PRECISION config marking compressed recipes ``weight_scale_encoding: csf``."""
    group = int(source.get("group_size", 16))
    out: dict[str, Any] = {k: v for k, v in source.items() if k not in ("quant_algo", "group_size", "quantized_layers")}
    out["quant_algo"] = "MIXED_PRECISION"
    layers: dict[str, dict[str, Any]] = {}
    if str(source.get("quant_algo", "")).upper() == "MIXED_PRECISION":
        layers.update({k: dict(v) for k, v in source.get("quantized_layers", {}).items()})
    else:
        for scale in all_scales:
            layers.setdefault(recipe_key(module_of(scale)), {"quant_algo": "NVFP4", "group_size": group})
    compressed_keys = {recipe_key(module_of(s)) for s in compressed_scales}
    for key in compressed_keys:
        recipe = layers.get(key)
        if recipe is None:
            # A MIXED_PRECISION source may key experts per projection; find the recipe.
            matches = [k for k in layers if k.startswith(key + ".") or key.startswith(k + ".")]
            if not matches:
                raise ConvertError(f"quantized_layers has no recipe for compressed module {key}")
            for k in matches:
                layers[k]["weight_scale_encoding"] = "csf"
            continue
        if str(recipe.get("quant_algo", "")).upper() != "NVFP4":
            raise ConvertError(f"recipe {key} is {recipe.get('quant_algo')}, not NVFP4")
        recipe["weight_scale_encoding"] = "csf"
    # Recipes left without compressed scales (partly compressed module) would be ambiguous.
    out["quantized_layers"] = layers
    return out


# ----------------------------------------------------------------------------- selection


def is_target(entry: TensorEntry, codec: CsfCodec, scope: str) -> bool:
    if scope == "experts" and not is_routed_expert(entry.name):
        return False
    if codec is NVFP4_CSF:
        return entry.name.endswith(".weight_scale") and entry.dtype in codec.scale_dtypes and len(entry.shape) == 2
    return (
        entry.name.endswith(("scale", "scales"))
        and entry.dtype in codec.scale_dtypes
        and len(entry.shape) >= 2
        and "input" not in entry.name.rsplit(".", 1)[-1]
    )


# ----------------------------------------------------------------------------- atomic output


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_output_dir(dst: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of ``dst``; rename it to ``dst`` only on success."""
    dst = dst.resolve()
    if dst.exists() and not force:
        raise ConvertError(f"{dst} exists; pass --force to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{dst.name}.csf-partial-"
    for stale in dst.parent.glob(prefix + "*"):
        pid = stale.name[len(prefix) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = dst.parent / f"{prefix}{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term) if _main_thread() else None
    try:
        yield tmp
        for path in tmp.rglob("*"):
            if path.is_file():
                with path.open("rb") as f:
                    os.fsync(f.fileno())
        if dst.exists():
            trash = dst.parent / f"{prefix}{os.getpid()}-old-{time.time_ns()}"
            dst.rename(trash)
            tmp.rename(dst)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# ----------------------------------------------------------------------------- progress


class Progress:
    def __init__(self, verb: str, total_bytes: int, stream: Any = None, quiet: bool = False) -> None:
        self.verb, self.total, self.done = verb, max(total_bytes, 1), 0
        self.start = self.last = time.monotonic()
        self.stream = stream or sys.stderr
        self.quiet = quiet

    def advance(self, nbytes: int, label: str, force: bool = False) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.quiet or (not force and now - self.last < 2.0):
            return
        self.last = now
        rate = self.done / max(now - self.start, 1e-9) / 1e6
        print(
            f"csf-convert {self.verb}: {100 * self.done / self.total:5.1f} % "
            f"({self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB, {rate:.0f} MB/s) {label}",
            file=self.stream,
            flush=True,
        )


# ----------------------------------------------------------------------------- encode


@dataclass
class ShardResult:
    receipt: dict[str, Any]
    names: list[str]
    compressed: list[str]
    all_scales: list[str]


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def encode_shard(
    src: Path, out: Path, codec: CsfCodec, scope: str, extra_metadata: dict[str, str], progress: Progress
) -> ShardResult:
    items: list[tuple[str, str, tuple[int, ...], int]] = []
    chunks: list[memoryview | bytes] = []
    tensors_receipt: dict[str, Any] = {}
    compressed: list[str] = []
    all_scales: list[str] = []
    with ShardReader(src) as reader:
        header = reader.header
        for entry in header.tensors.values():
            if codec is NVFP4_CSF and entry.name.endswith(".weight_scale") and entry.dtype in codec.scale_dtypes:
                all_scales.append(entry.name)
            if not is_target(entry, codec, scope):
                items.append((entry.name, entry.dtype, entry.shape, entry.nbytes))
                chunks.append(reader.raw(entry.name))
                continue
            rows, cols = logical_2d(entry.shape)
            scales = reader.tensor(entry.name).view(torch.uint8).reshape(rows, cols)
            try:
                plane = encode(scales, codec, what=f"{src}: {entry.name}")
            except CsfFormatError as exc:
                raise ConvertError(f"{exc} (use --scope to leave it uncompressed)") from None
            fixed_name, exc_name = entry.name + codec.fixed_suffix, entry.name + codec.exceptions_suffix
            items.append((fixed_name, "U8", tuple(plane.fixed.shape), plane.fixed.numel()))
            chunks.append(tensor_bytes(plane.fixed))
            items.append((exc_name, "U32", (plane.exceptions.numel(),), 4 * plane.exceptions.numel()))
            chunks.append(tensor_bytes(plane.exceptions))
            tensors_receipt[entry.name] = {
                "shape": list(entry.shape),
                "dtype": entry.dtype,
                "fixed_bytes": plane.fixed.numel(),
                "exception_bytes": 4 * plane.exceptions.numel(),
                "exceptions": plane.exceptions.numel(),
                "source_bytes": entry.nbytes,
                "source_sha256": hashlib.sha256(reader.raw(entry.name)).hexdigest(),
            }
            compressed.append(entry.name)
        metadata = dict(header.metadata)
        metadata.update(extra_metadata)
        new_header = layout_header(items, metadata)
        with out.open("wb") as f:
            write_shard(f, new_header, chunks)
        chunks.clear()
        receipt = {
            "shard": src.name,
            "codec": codec.name,
            "source_bytes": src.stat().st_size,
            "source_sha256": _sha256_file(src),
            "source_header": header.header_text,
            "tensors": tensors_receipt,
        }
        progress.advance(src.stat().st_size, src.name, force=True)
    return ShardResult(receipt, [i[0] for i in items], compressed, all_scales)


def encode_checkpoint(
    src: Path,
    dst: Path,
    codec: CsfCodec | None = None,
    scope: str = "experts",
    force: bool = False,
    quiet: bool = False,
) -> dict[str, Any]:
    """Convert a standard checkpoint directory to CSF; return a summary."""
    src = src.resolve()
    config_path = src / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{src}: config.json is missing")
    config = json.loads(config_path.read_text())
    codec = codec or detect_codec(config)
    shards = shard_names(src)
    check_source_scales(src, shards, codec)  # headers only: dtypes, truncation, scale/weight fit
    progress = Progress("encode", sum((src / s).stat().st_size for s in shards), quiet=quiet)
    summary: dict[str, Any] = {"codec": codec.name, "shards": len(shards), "tensors": 0}
    with atomic_output_dir(dst, force) as tmp:
        mx = codec is MXFP4_CSF
        tensor_dir = tmp / MXFP4_TENSORS if mx else tmp
        receipts_dir = tmp / (MXFP4_RECEIPTS if mx else NVFP4_RECEIPTS)
        tensor_dir.mkdir(exist_ok=True)
        (receipts_dir / SOURCE_FILES).mkdir(parents=True)
        extra = {"schema": MXFP4_SCHEMA, "codec": codec.name} if mx else {"csf_codec": codec.name}
        weight_map: dict[str, str] = {}
        compressed: list[str] = []
        all_scales: list[str] = []
        totals = {"source": 0, "fixed": 0, "exceptions": 0, "words": 0, "scales": 0}
        for name in shards:
            result = encode_shard(src / name, tensor_dir / name, codec, scope, extra, progress)
            (receipts_dir / f"{name}.json").write_text(json.dumps(result.receipt, indent=1))
            weight_map.update(dict.fromkeys(result.names, name))
            compressed += result.compressed
            all_scales += result.all_scales
            for t in result.receipt["tensors"].values():
                totals["source"] += t["source_bytes"]
                totals["fixed"] += t["fixed_bytes"]
                totals["exceptions"] += t["exception_bytes"]
                totals["words"] += t["exceptions"]
                totals["scales"] += t["source_bytes"]
        if not compressed:
            raise ConvertError(f"{src}: no {codec.family.upper()} scale tensor matched scope {scope!r}")
        # Non-tensor files travel unchanged; the source config and index are kept for decode.
        for path in sorted(src.iterdir()):
            if path.is_file() and not path.name.endswith(".safetensors") and path.name != INDEX:
                shutil.copy2(path, tmp / path.name)
        shutil.copy2(config_path, receipts_dir / SOURCE_FILES / "config.json")
        if (src / INDEX).exists():
            shutil.copy2(src / INDEX, receipts_dir / SOURCE_FILES / INDEX)
        new_config = json.loads(config_path.read_text())
        holder = quant_holder(new_config)
        if mx:
            holder["quantization_config"] = {
                **holder["quantization_config"],
                "quant_method": "mxfp4_csf",
                "format_version": 1,
                "source_quant_method": holder["quantization_config"].get("quant_method"),
            }
            layers = sorted({layer for n in compressed if (layer := layer_of(n)) is not None})
            family = {
                "name": str(config.get("model_type", "unknown")),
                "compressed_layers": [layers[0], layers[-1] + 1] if layers else [0, 0],
            }
            shard_list = [
                {"file": n, "bytes": (tensor_dir / n).stat().st_size, "sha256": _sha256_file(tensor_dir / n)}
                for n in shards
            ]
            common = {"schema": MXFP4_SCHEMA, "codec": codec.name, "family": family["name"]}
            (tmp / MANIFEST).write_text(
                json.dumps({**common, "compressed_layers": family["compressed_layers"], "shards": shard_list}, indent=1)
            )
            (tmp / BUILD_CONTRACT).write_text(
                json.dumps(
                    {
                        **common,
                        "compressed_layers": family["compressed_layers"],
                        "source_names": weight_map,
                        "compressed_tensors": sorted(compressed),
                        "tool": "csf-convert (vllm-csf-loader)",
                    },
                    indent=1,
                )
            )
        else:
            holder["quantization_config"] = csf_quant_config(holder["quantization_config"], compressed, all_scales)
            total_size = sum((tensor_dir / n).stat().st_size for n in shards)
            (tmp / INDEX).write_text(
                json.dumps(
                    {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}, indent=2
                )
            )
            hf_quant = tmp / "hf_quant_config.json"
            if hf_quant.exists():
                # Stock reads config.json's quantization_config first; a stale legacy file would disagree.
                hf_quant.unlink()
        (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
        compressed_bytes = totals["fixed"] + totals["exceptions"]
        summary.update(
            tensors=len(compressed),
            source_scale_bytes=totals["source"],
            compressed_scale_bytes=compressed_bytes,
            compression_ratio=totals["source"] / max(compressed_bytes, 1),
            exception_rate=totals["words"] / max(totals["scales"], 1),
        )
        (receipts_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


# ----------------------------------------------------------------------------- decode / verify


def csf_layout(root: Path) -> tuple[CsfCodec, Path, Path, list[str]]:
    """(codec, tensor folder, receipts folder, shards) of a CSF checkpoint produced by encode.

    An MXFP4-CSF container is checked as a loader checks it (``layout.read_container``)."""
    if is_mxfp4_container(root):
        container = read_container(root)
        return MXFP4_CSF, container.tensor_dir, root / MXFP4_RECEIPTS, container.shards
    if (root / NVFP4_RECEIPTS).is_dir():
        return NVFP4_CSF, root, root / NVFP4_RECEIPTS, shard_names(root)
    raise CheckpointError(f"{root}: neither an MXFP4-CSF container nor an NVFP4-CSF checkpoint with receipts")


def rebuilt_source_chunks(csf_shard: Path, receipt: dict[str, Any], codec: CsfCodec) -> Iterator[memoryview | bytes]:
    """The bytes of the source shard, rebuilt from the CSF shard and its receipt."""
    header_text: str = receipt["source_header"]
    header_bytes = header_text.encode("utf-8")
    source = json.loads(header_text)
    source.pop("__metadata__", None)
    entries = sorted(source.items(), key=lambda kv: kv[1]["data_offsets"][0])
    compressed: dict[str, Any] = receipt["tensors"]
    yield len(header_bytes).to_bytes(8, "little")
    yield header_bytes
    with ShardReader(csf_shard) as reader:
        offset = 0
        for name, info in entries:
            begin, end = info["data_offsets"]
            if begin != offset:
                raise CheckpointError(f"{csf_shard}: receipt header has a gap before tensor {name}")
            if name in compressed:
                shape = tuple(compressed[name]["shape"])
                rows, cols = logical_2d(shape)
                fixed_name, exc_name = name + codec.fixed_suffix, name + codec.exceptions_suffix
                for part in (fixed_name, exc_name):
                    if part not in reader.header.tensors:
                        raise CheckpointError(f"{csf_shard}: tensor {part} is missing (stream without its partner)")
                plane = CsfPlane(reader.tensor(fixed_name), reader.tensor(exc_name))
                scales = decode(plane, codec, rows, cols, what=f"{csf_shard}: {name}")
                data: memoryview | bytes = tensor_bytes(scales)
            else:
                entry = reader.entry(name)
                if entry.dtype != info["dtype"] or list(entry.shape) != list(info["shape"]):
                    raise CheckpointError(
                        f"{csf_shard}: tensor {name}: {entry.dtype} {list(entry.shape)} differs from the source "
                        f"{info['dtype']} {info['shape']}"
                    )
                data = reader.raw(name)
            if len(data) != end - begin:
                raise CheckpointError(f"{csf_shard}: tensor {name}: {len(data)} bytes, source had {end - begin}")
            offset = end
            yield data


def decode_checkpoint(src: Path, dst: Path, force: bool = False, quiet: bool = False) -> dict[str, Any]:
    src = src.resolve()
    codec, tensor_dir, receipts_dir, shards = csf_layout(src)
    receipts = read_receipts(receipts_dir, shards)
    progress = Progress("decode", sum(r["source_bytes"] for r in receipts.values()), quiet=quiet)
    with atomic_output_dir(dst, force) as tmp:
        for name in shards:
            digest = hashlib.sha256()
            with (tmp / name).open("wb") as f:
                for chunk in rebuilt_source_chunks(tensor_dir / name, receipts[name], codec):
                    digest.update(chunk)
                    f.write(chunk)
            if digest.hexdigest() != receipts[name]["source_sha256"]:
                raise ConvertError(f"{tensor_dir / name}: rebuilt source shard does not match its receipt SHA-256")
            progress.advance(receipts[name]["source_bytes"], name, force=True)
        skip = {INDEX, MANIFEST, BUILD_CONTRACT, "config.json"}
        for path in sorted(src.iterdir()):
            if path.is_file() and path.name not in skip and not path.name.endswith(".safetensors"):
                shutil.copy2(path, tmp / path.name)
        for path in (receipts_dir / SOURCE_FILES).iterdir():
            shutil.copy2(path, tmp / path.name)
    return {"codec": codec.name, "shards": len(shards)}


def verify_checkpoint(src: Path, source: Path | None = None, quiet: bool = False) -> list[str]:
    """Return a list of problems (empty when every shard rebuilds to its receipt's SHA-256)."""
    src = src.resolve()
    codec, tensor_dir, receipts_dir, shards = csf_layout(src)
    receipts = read_receipts(receipts_dir, shards)
    progress = Progress("verify", sum(r["source_bytes"] for r in receipts.values()), quiet=quiet)
    problems = []
    if codec is MXFP4_CSF:
        manifest = json.loads((src / MANIFEST).read_text())
        for item in manifest["shards"]:
            if "sha256" in item and _sha256_file(tensor_dir / item["file"]) != item["sha256"]:
                problems.append(f"{tensor_dir / item['file']}: SHA-256 differs from manifest.json")
    for name in shards:
        digest = hashlib.sha256()
        try:
            for chunk in rebuilt_source_chunks(tensor_dir / name, receipts[name], codec):
                digest.update(chunk)
        except (CheckpointError, CsfFormatError) as exc:
            problems.append(str(exc))
            continue
        if digest.hexdigest() != receipts[name]["source_sha256"]:
            problems.append(f"{tensor_dir / name}: rebuilt source shard SHA-256 differs from its receipt")
        if source is not None:
            original = source / name
            if not original.is_file():
                problems.append(f"{original}: source shard is missing")
            elif _sha256_file(original) != digest.hexdigest():
                problems.append(f"{original}: differs from the shard rebuilt from {tensor_dir / name}")
        progress.advance(receipts[name]["source_bytes"], name, force=True)
    return problems


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="csf-convert", description="NVFP4 / MXFP4 checkpoints to CSF and back")
    sub = parser.add_subparsers(dest="command", required=True)
    enc = sub.add_parser("encode", help="standard NVFP4 / MXFP4 checkpoint -> CSF")
    enc.add_argument("src", type=Path)
    enc.add_argument("dst", type=Path)
    enc.add_argument("--codec", choices=["nvfp4", "mxfp4"], default=None, help="default: from quantization_config")
    enc.add_argument(
        "--scope",
        choices=["experts", "all"],
        default="experts",
        help="compress routed-expert scales only (default, as published) or every FP4 scale",
    )
    enc.add_argument("--force", action="store_true", help="replace DST if it exists")
    enc.add_argument("--quiet", action="store_true")
    dec = sub.add_parser("decode", help="CSF checkpoint -> the original checkpoint, bit for bit")
    dec.add_argument("src", type=Path)
    dec.add_argument("dst", type=Path)
    dec.add_argument("--force", action="store_true")
    dec.add_argument("--quiet", action="store_true")
    ver = sub.add_parser("verify", help="decode every plane; check each rebuilt shard's SHA-256")
    ver.add_argument("src", type=Path)
    ver.add_argument("--source", type=Path, default=None, help="also compare with the original shards here")
    ver.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "encode":
            codec = {"nvfp4": NVFP4_CSF, "mxfp4": MXFP4_CSF}.get(args.codec or "")
            summary = encode_checkpoint(args.src, args.dst, codec, args.scope, args.force, args.quiet)
            print(json.dumps(summary))
        elif args.command == "decode":
            print(json.dumps(decode_checkpoint(args.src, args.dst, args.force, args.quiet)))
        else:
            problems = verify_checkpoint(args.src, args.source, args.quiet)
            for p in problems:
                print(f"csf-convert verify: FAIL: {p}", file=sys.stderr)
            if problems:
                return 1
            print(f"csf-convert verify: OK: {args.src}")
    except (ConvertError, CheckpointError, CsfFormatError) as exc:
        print(f"csf-convert: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
