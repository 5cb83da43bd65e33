"""The ``csf`` load format: stock vLLM's safetensors loader plus CSF scale decoding.

Imported only from ``register_with_vllm`` (it imports vLLM). The loader is stock's
``DefaultModelLoader``; the only change is its weight stream: every
``<name>.nvfp4_csf_fixed`` / ``<name>.nvfp4_csf_exceptions`` pair is decoded
(``csf_loader.codec``, bit-exact, validated) into the plain E4M3 tensor ``<name>``
the source checkpoint had, so the model's own ``load_weights`` and stock's NVFP4
methods receive exactly the source bytes. For stock's parallel linear layers each rank
decodes only its TP extent from the compressed payload (``tp_extent_resolver``). Stock's
ModelOpt ``MIXED_PRECISION`` config reads the CSF ``config.json`` unchanged (it
ignores ``weight_scale_encoding``).

Startup checks (each error names the tensor, and the shard when known):
* before any tensor is read: missing or truncated shards, corrupt headers, CSF streams
  with wrong dtypes / shapes / no partner, scales that do not fit their weights
  (``preflight``);
* a stream without its partner, a base above 240, an exception outside the plane,
  wrong dtypes / shapes (codec validation);
* missing parameters (weights tracking on by default, also for quantized models);
  unexpected tensors are refused by the model's own ``AutoWeightsLoader``;
* expert parallelism (the TP-sliced scale planes assume every rank holds every
  expert);
* TP extents that do not keep whole 16-row slabs / nibble pairs of a compressed
  plane (see ``check_tp_geometry``).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from csf_loader.codec import (
    MXFP4_CSF,
    NVFP4_CSF,
    SLAB_ROWS,
    CsfFormatError,
    CsfPlane,
    decode,
    decode_region,
    nvfp4_plane_shape,
)
from csf_loader.layout import Container, is_mxfp4_container, logical_2d, read_container, read_index
from csf_loader.preflight import check_mxfp4_container, check_nvfp4_checkpoint
from csf_loader.safetensors_io import CheckpointError

logger = logging.getLogger("vllm.plugins.csf_loader")

LOAD_FORMAT = "csf"
FIXED, EXCEPTIONS = NVFP4_CSF.fixed_suffix, NVFP4_CSF.exceptions_suffix


class CsfLoadError(ValueError):
    """A CSF checkpoint cannot be loaded; the message names the tensor and file."""


def nvfp4_logical_shape(fixed: torch.Tensor, where: str) -> tuple[int, int]:
    plane = nvfp4_plane_shape(tuple(fixed.shape))
    if plane is None:
        raise CsfLoadError(f"{where}{FIXED}: shape {list(fixed.shape)} is not [rows / 16, 16 * (1 + cols / 2)]")
    return plane


Extent = tuple[tuple[int, int], tuple[int, int]]


def decode_csf_stream(
    weights: Iterable[tuple[str, torch.Tensor]],
    shard_of: dict[str, str] | None = None,
    extent_of: Callable[[str, int, int], Extent | None] | None = None,
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Replace every NVFP4-CSF pair in a weight stream by its decoded E4M3 tensor.

    With ``extent_of(name, rows, cols)`` returning this rank's ``((r0, r1), (c0, c1))``,
    only that region is decoded from the compressed payload (the slabs and code bytes it
    covers); it is placed in a full-shape tensor whose other bytes stock's weight loader
    never reads, since it narrows to exactly that region.
    """
    shard_of = shard_of or {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    planes = 0
    partial = 0
    seconds = 0.0
    decoded_bytes = 0
    for name, tensor in weights:
        suffix = FIXED if name.endswith(FIXED) else EXCEPTIONS if name.endswith(EXCEPTIONS) else None
        if suffix is None:
            yield name, tensor
            continue
        base = name[: -len(suffix)]
        parts = pending.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) < 2:
            continue
        del pending[base]
        where = f"{shard_of.get(name, '?')}: {base}"
        started = time.perf_counter()
        rows, cols = nvfp4_logical_shape(parts[FIXED], where)
        plane = CsfPlane(parts[FIXED], parts[EXCEPTIONS])
        extent = extent_of(base, rows, cols) if extent_of is not None else None
        try:
            if extent is None or extent == ((0, rows), (0, cols)):
                scales = decode(plane, NVFP4_CSF, rows, cols, what=where)
            else:
                (r0, r1), (c0, c1) = extent
                partial += 1
                scales = torch.empty(rows, cols, dtype=torch.uint8)
                scales[r0:r1, c0:c1] = decode_region(plane, NVFP4_CSF, rows, cols, (r0, r1), (c0, c1), what=where)
        except CsfFormatError as exc:
            raise CsfLoadError(str(exc)) from None
        seconds += time.perf_counter() - started
        planes += 1
        decoded_bytes += scales.numel()
        yield base, scales.view(torch.float8_e4m3fn)
    if pending:
        base, parts = next(iter(pending.items()))
        present = next(iter(parts))
        missing = FIXED if present == EXCEPTIONS else EXCEPTIONS
        raise CsfLoadError(
            f"{shard_of.get(base + present, '?')}: {base}{present} has no partner {base}{missing} "
            f"({len(pending)} unpaired CSF stream(s))"
        )
    if planes:
        logger.info(
            "csf_loader: decoded %d NVFP4-CSF scale planes (%d of them only this rank's TP extent, %.1f MB) in %.3f s",
            planes,
            partial,
            decoded_bytes / 1e6,
            seconds,
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


def check_parallel_config() -> None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None and config.parallel_config.enable_expert_parallel:
        raise CsfLoadError(
            "csf_loader: expert parallelism is not supported for CSF checkpoints: the compressed "
            "expert scale planes are sliced by tensor parallelism, with every rank holding every "
            "expert; run without --enable-expert-parallel"
        )


def check_tp_geometry(model: nn.Module, planes: dict[str, str], tp_size: int) -> None:
    """Refuse TP sizes that cut a compressed plane inside a 16-row slab or a nibble pair.

    Column-parallel layers split the scale rows (output channels): each rank needs a
    multiple of 16 rows, i.e. of 16 output channels. Row-parallel layers split the
    scale columns (input channels / 16): each rank needs an even count, i.e. a
    multiple of 32 input channels.
    """
    if tp_size == 1 or not planes:
        return
    for module_name, module in model.named_modules():
        scale = getattr(module, "weight_scale", None)
        if not isinstance(scale, torch.Tensor) or scale.dim() != 2:
            continue
        rows, cols = scale.shape
        layer = module_name
        if rows % SLAB_ROWS:
            raise CsfLoadError(
                f"csf_loader: TP={tp_size} gives {layer} {rows} output channels per rank; NVFP4-CSF needs a "
                f"multiple of {SLAB_ROWS} per rank (whole 16-row slabs). Use a TP size that divides it."
            )
        if cols % 2:
            raise CsfLoadError(
                f"csf_loader: TP={tp_size} gives {layer} {cols * 16} input channels per rank; NVFP4-CSF needs "
                f"a multiple of 32 per rank (whole bytes of two 4-bit codes). Use a TP size that divides it."
            )


def read_mxfp4_contract(root: Path) -> Container:
    """``layout.read_container``, its errors as startup errors of the load format."""
    try:
        return read_container(root)
    except CheckpointError as exc:
        raise CsfLoadError(str(exc)) from None


def mxfp4_container_stream(root: Path) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Source-named tensors of an MXFP4-CSF container, compressed scales decoded."""
    from safetensors import safe_open

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
                    yield name, f.get_tensor(name)
                    continue
                base = name[: -len(fixed_sfx)]
                if base + exc_sfx not in present:
                    raise CsfLoadError(f"{path}: {name} has no partner {base}{exc_sfx}")
                if base not in compressed:
                    raise CsfLoadError(f"{path}: {base} is compressed but has no receipt entry (shape unknown)")
                shape = tuple(compressed[base]["shape"])
                rows, cols = logical_2d(shape)
                plane = CsfPlane(f.get_tensor(name), f.get_tensor(base + exc_sfx))
                try:
                    scales = decode(plane, MXFP4_CSF, rows, cols, what=f"{path}: {base}")
                except CsfFormatError as exc:
                    raise CsfLoadError(str(exc)) from None
                out = scales.reshape(shape)
                if compressed[base].get("dtype") == "F8_E8M0":
                    out = out.view(torch.float8_e8m0fnu)
                yield base, out
            for name in present:
                if name.endswith(exc_sfx) and name[: -len(exc_sfx)] + fixed_sfx not in present:
                    raise CsfLoadError(f"{path}: {name} has no partner {name[: -len(exc_sfx)]}{fixed_sfx}")


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


def tp_extent_resolver(model: nn.Module) -> Callable[[str, int, int], Extent | None]:
    """This rank's region of a checkpoint scale matrix, from the stock layer that loads it.

    Covers exactly stock's ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear
    (with replicated KV heads) and RowParallelLinear; anything else (subclasses, unknown
    names, replicated layers, MoE experts) returns None and is decoded whole, which is
    always correct. The TP=2 engine test checks every rank's parameters byte for byte.
    """
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    modules = dict(model.named_modules())
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})

    def resolve(scale_name: str, rows: int, cols: int) -> Extent | None:
        module_path = scale_name.rsplit(".", 1)[0]
        module = modules.get(module_path)
        shard = None
        if module is None and "." in module_path:
            parent, leaf = module_path.rsplit(".", 1)
            for fused, parts in packed.items():
                if leaf in parts and parent + "." + fused in modules:
                    module, shard = modules[parent + "." + fused], leaf
                    break
        if module is None:
            return None
        tp, rank = int(getattr(module, "tp_size", 1)), int(getattr(module, "tp_rank", 0))
        if tp == 1:
            return None
        full_rows, full_cols = (0, rows), (0, cols)
        if type(module) is RowParallelLinear:
            if not module.input_is_parallel or cols % tp:
                return None
            local = cols // tp
            return full_rows, (rank * local, (rank + 1) * local)
        if type(module) is QKVParallelLinear and shard is not None:
            index = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}.get(shard)
            if index is None:
                return None
            if index == "q":
                local, at = module.num_heads * module.head_size, rank
            else:
                head = module.head_size if index == "k" else module.v_head_size
                local, at = module.num_kv_heads * head, rank // module.num_kv_head_replicas
            if local * (at + 1) > rows:
                return None
            return (at * local, (at + 1) * local), full_cols
        if (type(module) is MergedColumnParallelLinear and shard is not None) or (
            type(module) is ColumnParallelLinear and shard is None
        ):
            if rows % tp:
                return None
            local = rows // tp
            return (rank * local, (rank + 1) * local), full_cols
        return None

    return resolve


class CsfModelLoader(DefaultModelLoader):
    """Stock safetensors loading with NVFP4-CSF pairs decoded into plain E4M3 scales."""

    def __init__(self, load_config: Any) -> None:
        # Stock's file discovery dispatches on the load format name; a CSF checkpoint is
        # plain safetensors on disk, so the parent sees a copy that says so.
        own = copy.copy(load_config)
        own.load_format = "safetensors"
        super().__init__(own)
        # Missing tensors must fail at startup for quantized checkpoints too (R40).
        if self.enable_weights_track is None:
            self.enable_weights_track = True

    def get_all_weights(
        self, model_config: ModelConfig, model: nn.Module
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        if is_mxfp4_container(model_config.model):
            yield from mxfp4_container_stream(Path(model_config.model))
            return
        shard_of = shard_index(model_config.model)
        extent_of = tp_extent_resolver(model)
        yield from decode_csf_stream(super().get_all_weights(model_config, model), shard_of, extent_of)

    def download_model(self, model_config: ModelConfig) -> None:
        if is_mxfp4_container(model_config.model):
            read_mxfp4_contract(Path(model_config.model))  # local only: validate at startup
            return
        super().download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        from vllm.distributed import get_tensor_model_parallel_world_size

        check_parallel_config()
        preflight(model_config.model)
        planes = csf_planes(model_config.model)
        check_tp_geometry(model, planes, get_tensor_model_parallel_world_size())
        super().load_weights(model, model_config)


class Mxfp4CsfConfig(Mxfp4Config):
    """``mxfp4_csf``: stock's ``Mxfp4Config`` under the name a CSF container's config.json uses.

    The container decodes to the source MXFP4 tensors (``csf`` load format), so stock's
    MXFP4 methods are used unchanged; this class only lets vLLM accept
    ``quant_method: mxfp4_csf`` and refuses expert parallelism at startup. It lives at
    module level: vLLM pickles the config into its engine-core and worker processes.
    """

    @classmethod
    def get_name(cls) -> Any:  # stock types this as a Literal of its own method names
        return "mxfp4_csf"

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: Any, hf_config: Any = None) -> Any:
        if isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") == "mxfp4_csf":
            return "mxfp4_csf"
        return None

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Any:
        check_parallel_config()
        return super().get_quant_method(layer, prefix)


def make_mxfp4_csf_config() -> type:
    return Mxfp4CsfConfig
