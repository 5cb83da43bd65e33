"""Startup checks of a checkpoint's files before any tensor is read (no vLLM import).

Run by the ``csf`` load format before stock's weight loading, so bad input fails with
the file and tensor named instead of deep inside a reader or a weight loader:
* every shard the index (or an MXFP4-CSF manifest) names exists;
* every shard's safetensors header parses and its tensors fit the file (truncation);
* CSF streams have their dtypes (fixed ``U8``, exceptions ``U32``, 1-D), shapes and
  partner;
* each FP4 scale matrix (plain or CSF-coded) fits its weight: NVFP4 ``weight`` ``U8
  [rows, 8 * cols]`` for a ``[rows, cols]`` scale; MXFP4 ``weight`` ``U8 [..., rows,
  16 * cols]`` for a ``[..., rows, cols]`` scale.
Only headers are read (a few kilobytes per shard).
"""

from __future__ import annotations

from pathlib import Path

from csf_loader.codec import MXFP4_CSF, NVFP4_CSF, SLAB_ROWS, CsfCodec, nvfp4_plane_shape
from csf_loader.layout import INDEX, MANIFEST, MXFP4_RECEIPTS, Container, logical_2d, read_index
from csf_loader.safetensors_io import CheckpointError, ShardHeader, TensorEntry, read_header


def shard_headers(root: Path, shards: list[str], named_by: Path | None) -> dict[str, ShardHeader]:
    headers: dict[str, ShardHeader] = {}
    for shard in shards:
        path = root / shard
        if not path.is_file():
            by = f"{named_by} names shard {shard}, which" if named_by else f"shard {path}"
            raise CheckpointError(f"{by} is missing from {root}")
        headers[shard] = read_header(path)
    return headers


def _entries(headers: dict[str, ShardHeader]) -> dict[str, tuple[str, TensorEntry]]:
    found: dict[str, tuple[str, TensorEntry]] = {}
    for shard, header in headers.items():
        for name, entry in header.tensors.items():
            if name in found:
                raise CheckpointError(f"{header.path}: tensor {name} is also stored in {found[name][0]}")
            found[name] = (shard, entry)
    return found


def _check_weight_fits(
    entries: dict[str, tuple[str, TensorEntry]], root: Path, scale: str, shape: tuple[int, ...], per_byte_cols: int
) -> None:
    """The packed ``<module>.weight`` next to a scale must hold ``per_byte_cols`` bytes per scale."""
    weight = scale.rsplit(".", 1)[0] + ".weight"
    if weight not in entries or not scale.endswith(".weight_scale"):
        return
    shard, w = entries[weight]
    if w.dtype != "U8":
        return
    expected = (*shape[:-1], shape[-1] * per_byte_cols)
    if tuple(w.shape) != expected:
        raise CheckpointError(
            f"{root / shard}: tensor {weight}: shape {list(w.shape)} does not match its scale {scale} "
            f"{list(shape)} (expected {list(expected)})"
        )


def check_nvfp4_checkpoint(root: Path) -> None:
    """Standard NVFP4 or NVFP4-CSF checkpoint directory (index optional)."""
    index = root / INDEX
    weight_map = read_index(root)
    if weight_map is not None:
        shards = sorted(set(weight_map.values()))
        headers = shard_headers(root, shards, index)
        for name, shard in weight_map.items():
            if name not in headers[shard].tensors:
                raise CheckpointError(f"{index}: maps tensor {name} to {shard}, which does not hold it")
    else:
        headers = shard_headers(root, sorted(p.name for p in root.glob("*.safetensors")), None)
    entries = _entries(headers)
    fixed_sfx, exc_sfx = NVFP4_CSF.fixed_suffix, NVFP4_CSF.exceptions_suffix
    for name, (shard, entry) in entries.items():
        where = f"{root / shard}: tensor {name}"
        if name.endswith(fixed_sfx):
            base = name[: -len(fixed_sfx)]
            if base + exc_sfx not in entries:
                raise CheckpointError(f"{where} has no partner {base}{exc_sfx}")
            plane = nvfp4_plane_shape(entry.shape)
            if entry.dtype != "U8" or plane is None:
                raise CheckpointError(
                    f"{where}: {entry.dtype} {list(entry.shape)}; expected U8 [rows / 16, 16 * (1 + cols / 2)]"
                )
            _check_weight_fits(entries, root, base, plane, NVFP4_CSF.weight_bytes_per_scale)
        elif name.endswith(exc_sfx):
            base = name[: -len(exc_sfx)]
            if base + fixed_sfx not in entries:
                raise CheckpointError(f"{where} has no partner {base}{fixed_sfx}")
            if entry.dtype != "U32" or len(entry.shape) != 1:
                raise CheckpointError(f"{where}: {entry.dtype} {list(entry.shape)}; expected 1-D U32 exception words")
        elif name.endswith(".weight_scale") and entry.dtype in NVFP4_CSF.scale_dtypes and len(entry.shape) == 2:
            _check_weight_fits(entries, root, name, tuple(entry.shape), NVFP4_CSF.weight_bytes_per_scale)


def check_mxfp4_container(container: Container) -> None:
    """Shards of a checked MXFP4-CSF container (``layout.read_container``) against their receipts."""
    root, tensors = container.root, container.tensor_dir
    headers = shard_headers(tensors, container.shards, root / MANIFEST)
    entries = _entries(headers)
    fixed_sfx, exc_sfx = MXFP4_CSF.fixed_suffix, MXFP4_CSF.exceptions_suffix
    for shard in container.shards:
        for base, info in container.compressed(shard).items():
            where = f"{tensors / shard}: tensor {base}"
            shape = tuple(int(d) for d in info.get("shape", ()))
            if len(shape) < 2:
                raise CheckpointError(f"{root / MXFP4_RECEIPTS / (shard + '.json')}: {base}: bad shape {list(shape)}")
            for sfx, dtype in ((fixed_sfx, "U8"), (exc_sfx, "U32")):
                if base + sfx not in headers[shard].tensors:
                    raise CheckpointError(f"{where}{sfx} is missing (its receipt lists {base} as compressed)")
                entry = headers[shard].tensors[base + sfx]
                if entry.dtype != dtype or len(entry.shape) != 1:
                    raise CheckpointError(
                        f"{where}{sfx}: {entry.dtype} {list(entry.shape)}; expected a 1-D {dtype} stream"
                    )
            rows, cols = logical_2d(shape)
            fixed = headers[shard].tensors[base + fixed_sfx]
            if rows % SLAB_ROWS:
                raise CheckpointError(f"{where}: receipt shape {list(shape)} is not whole 16-row slabs")
            if fixed.shape[0] != MXFP4_CSF.fixed_numel(rows, cols):
                raise CheckpointError(
                    f"{where}{fixed_sfx}: {fixed.shape[0]} bytes do not code the receipt's {list(shape)} scales "
                    f"({MXFP4_CSF.fixed_numel(rows, cols)} bytes)"
                )
            _check_weight_fits(entries, tensors, base, shape, MXFP4_CSF.weight_bytes_per_scale)


def check_source_scales(root: Path, shards: list[str], codec: CsfCodec) -> None:
    """A standard FP4 source for ``csf-convert encode``: every ``<m>.weight_scale`` next to a
    packed ``U8`` ``<m>.weight`` has the format's dtype and fits the weight."""
    entries = _entries(shard_headers(root, shards, None))
    dtypes, per_byte_cols, family = codec.scale_dtypes, codec.weight_bytes_per_scale, codec.family
    for name, (shard, entry) in entries.items():
        weight = name.removesuffix(".weight_scale") + ".weight"
        if not name.endswith(".weight_scale") or weight not in entries or entries[weight][1].dtype != "U8":
            continue
        if entry.dtype not in dtypes or len(entry.shape) < 2:
            raise CheckpointError(
                f"{root / shard}: tensor {name}: {entry.dtype} {list(entry.shape)}; a {family.upper()} block scale "
                f"of a packed FP4 weight must be {' or '.join(dtypes)} with at least 2 dimensions"
            )
        _check_weight_fits(entries, root, name, tuple(entry.shape), per_byte_cols)
