"""Where things are in a CSF checkpoint: every file name, schema and contract rule, defined once.

Used by the converter (``convert``), the startup checks (``preflight``) and the ``csf`` load
format (``vllm_loader``); no vLLM import.

* NVFP4-CSF: ordinary safetensors shards and ``model.safetensors.index.json`` in the checkpoint
  folder; the converter's receipts in ``csf-receipts/`` (loaders ignore them).
* MXFP4-CSF, a ``lil-mxfp4-csf-checkpoint/1`` container: shards under ``tensors/``,
  ``manifest.json`` and ``build-contract.json`` (the same schema, codec, model family and
  compressed layer range in both), ``receipts/<shard>.json`` per shard (the logical shape of each
  compressed tensor, its byte counts and the source shard's header and SHA-256); no top-level
  index. ``read_container`` checks all of it and returns what a reader needs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from csf_loader.codec import MXFP4_CSF
from csf_loader.safetensors_io import CheckpointError

INDEX = "model.safetensors.index.json"
MXFP4_SCHEMA = "lil-mxfp4-csf-checkpoint/1"
MANIFEST = "manifest.json"
BUILD_CONTRACT = "build-contract.json"
MXFP4_TENSORS = "tensors"
MXFP4_RECEIPTS = "receipts"
NVFP4_RECEIPTS = "csf-receipts"
SOURCE_FILES = "source-files"  # inside the receipts folder: the source config.json / index

# The decoder layer a tensor belongs to: ``...layers.<N>.`` (also ``model.language_model.layers.N.``).
LAYER_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# A routed expert's projection module, ``<layer>.mlp.experts.<N>.<proj>``: group 1 is the layer's
# ``...experts`` module (one quantization recipe, one ModelOpt ``ignore`` wildcard for all of them).
ROUTED_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.[^.]+$")


def experts_module(module: str) -> str | None:
    """``<layer>.mlp.experts`` for a routed expert's projection module, None for anything else."""
    m = ROUTED_EXPERT.match(module)
    return m.group(1) if m else None


def is_routed_expert(name: str) -> bool:
    """A tensor of a routed expert (``.experts.`` in its name; shared experts are not routed)."""
    return ".experts." in name and "shared_expert" not in name


def layer_of(name: str) -> int | None:
    """The decoder layer index in a tensor name, None when it names none."""
    m = LAYER_PATTERN.search(name)
    return int(m.group(1)) if m else None


def logical_2d(shape: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """A scale tensor's shape as the one plane CSF codes: leading dimensions fold into rows
    (a stacked ``[experts, rows, cols]`` plane is ``[experts * rows, cols]``)."""
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows, int(shape[-1])


def is_mxfp4_container(root: Path | str) -> bool:
    return (Path(root) / MANIFEST).is_file()


def read_index(root: Path) -> dict[str, str] | None:
    """The index's ``weight_map`` (tensor -> shard), None without an index."""
    index = root / INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: unreadable index ({exc})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: unreadable index (weight_map is not an object)")
    return {str(k): str(v) for k, v in weight_map.items()}


def shard_names(root: Path) -> list[str]:
    """The shards of a safetensors checkpoint folder: those the index names (each must exist
    there), else every ``*.safetensors`` file."""
    weight_map = read_index(root)
    if weight_map is not None:
        names = sorted(set(weight_map.values()))
        for name in names:
            if Path(name).name != name or not (root / name).is_file():
                raise CheckpointError(f"{root / INDEX} names shard {name}, which is missing from {root}")
        return names
    names = sorted(p.name for p in root.glob("*.safetensors"))
    if not names:
        raise CheckpointError(f"{root}: no safetensors shards")
    return names


def read_receipts(receipts_dir: Path, shards: list[str]) -> dict[str, dict[str, Any]]:
    """``<receipts_dir>/<shard>.json`` of every shard; a missing or unreadable one is an error."""
    receipts: dict[str, dict[str, Any]] = {}
    for name in shards:
        path = receipts_dir / f"{name}.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: receipt for shard {name} is missing")
        try:
            receipts[name] = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: unreadable receipt ({exc})") from None
    return receipts


@dataclass(frozen=True)
class Container:
    """What a reader needs of a checked MXFP4-CSF container."""

    root: Path
    shards: list[str]  # file names under tensors/, in manifest order
    receipts: dict[str, dict[str, Any]]  # shard -> receipt
    family: str
    layers: tuple[int, int]  # [first, end) of the decoder layers that hold compressed tensors

    @property
    def tensor_dir(self) -> Path:
        return self.root / MXFP4_TENSORS

    def compressed(self, shard: str) -> dict[str, Any]:
        """The shard's compressed tensors: source name -> receipt entry (``shape``, ``dtype``, ...)."""
        tensors: dict[str, Any] = self.receipts[shard].get("tensors", {})
        return tensors


def read_container(root: Path) -> Container:
    """Check ``manifest.json`` / ``build-contract.json`` / the receipts of an MXFP4-CSF container.

    Only schema ``lil-mxfp4-csf-checkpoint/1`` and codec ``row-base-offset1-u24-exceptions/1``
    are accepted (readers reject predecessor schemas); both documents must name the same model
    family and compressed layer range; every shard the manifest lists must exist under
    ``tensors/`` and have a receipt; every compressed tensor must lie in the layer range. Errors
    name the file.
    """
    docs: dict[str, dict[str, Any]] = {}
    for doc in (MANIFEST, BUILD_CONTRACT):
        path = root / doc
        if not path.is_file():
            raise CheckpointError(f"{path}: missing from the MXFP4-CSF container")
        try:
            docs[doc] = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: unreadable ({exc})") from None
    manifest, contract = docs[MANIFEST], docs[BUILD_CONTRACT]
    for key, expected in (("schema", MXFP4_SCHEMA), ("codec", MXFP4_CSF.name)):
        for doc, data in docs.items():
            if data.get(key) != expected:
                raise CheckpointError(f"{root / doc}: {key} {data.get(key)!r}; this reader accepts only {expected!r}")
    family = manifest.get("family")
    if family != contract.get("family") or not family:
        raise CheckpointError(f"{root}: manifest.json and build-contract.json must name the same model family")
    layers = manifest.get("compressed_layers")
    if layers != contract.get("compressed_layers") or not isinstance(layers, list) or len(layers) != 2:
        raise CheckpointError(f"{root}: the family's compressed layer range differs between manifest and contract")
    shards = [str(item["file"]) for item in manifest.get("shards", [])]
    for name in shards:
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise CheckpointError(f"{root / MANIFEST}: shard name {name!r} is not a local safetensors file")
        if not (root / MXFP4_TENSORS / name).is_file():
            raise CheckpointError(f"{root / MANIFEST}: names shard {name}, missing from {root / MXFP4_TENSORS}")
    receipts = read_receipts(root / MXFP4_RECEIPTS, shards)
    if set(contract.get("source_names", {}).values()) - set(shards):
        raise CheckpointError(f"{root}: build-contract.json maps tensors to shards the manifest does not list")
    first, end = int(layers[0]), int(layers[1])
    for name, receipt in receipts.items():
        for tensor in receipt.get("tensors", {}):
            layer = layer_of(tensor)
            if layer is None or not first <= layer < end:
                raise CheckpointError(
                    f"{root / MXFP4_TENSORS / name}: compressed tensor {tensor} lies outside the family's compressed "
                    f"layer range [{first}, {end})"
                )
    return Container(root, shards, receipts, str(family), (first, end))
