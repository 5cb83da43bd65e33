"""The ``csf`` load format: stock vLLM's safetensors loader plus CSF scale decoding.

Imported only from ``register_with_vllm`` (it imports vLLM). The loader is stock's
``DefaultModelLoader``; the only change is its weight stream: every
``<name>.nvfp4_csf_fixed`` / ``<name>.nvfp4_csf_exceptions`` pair is decoded
(bit-exact, validated) into the plain E4M3 tensor ``<name>`` the source checkpoint had, so
the model's own ``load_weights`` and stock's NVFP4 methods receive exactly the source bytes.
The decode runs where the model's parameters are (``device_decode.PlaneDecoder``): on CUDA the
compressed streams go to the GPU and the Triton kernel decodes them there as they stream in, a
window of planes at a time (``stream.PlaneWindow``: up to 128 planes, or 32 MB of them and the tensors
between them held back, checked, copied and decoded per shape at once), in line with stock's copies
(``CSF_LOADER_READ_AHEAD=1``: the whole stream produced on a thread ahead of them, ``read_ahead``); on
CPU the torch codec decodes on the host, and for stock's parallel linear layers each rank decodes only its TP extent
from the compressed payload (``tp_extent_resolver``).
Stock's ModelOpt ``MIXED_PRECISION`` config reads the CSF ``config.json`` unchanged (it
ignores ``weight_scale_encoding``).

Startup checks (each error names the tensor, and the shard when known):
* before any tensor is read: missing or truncated shards, corrupt headers, CSF streams
  with wrong dtypes / shapes / no partner, scales that do not fit their weights
  (``preflight``);
* a stream without its partner, a base above 240, an exception outside the plane,
  wrong dtypes / shapes (codec validation, the same checks and messages on the GPU);
* the GPU running out of memory while decoding (naming the tensor and the bytes needed);
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
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from csf_loader.codec import SLAB_ROWS
from csf_loader.device_decode import DecodeConfigError, PlaneDecoder, kernel_for_or_none
from csf_loader.layout import is_mxfp4_container
from csf_loader.read_ahead import ReadAheadConfigError, read_ahead, read_ahead_enabled
from csf_loader.stream import (
    CsfLoadError,
    Extent,
    csf_planes,
    decode_csf_stream,
    mxfp4_container_stream,
    preflight,
    read_mxfp4_contract,
    shard_index,
)
from csf_loader.triton_decode import prefetch_triton_start

LOAD_FORMAT = "csf"

logger = logging.getLogger("vllm.plugins.csf_loader")


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
        try:
            self.read_ahead = read_ahead_enabled()
        except ReadAheadConfigError as exc:
            raise CsfLoadError(f"csf_loader: {exc}") from None
        # The loader is built just before the model: Triton's per-process start (its installation
        # hash) runs beside building the model and reading the weights instead of inside the
        # first decode launch (triton_decode.TritonStart).
        if torch.cuda.is_available() and kernel_for_or_none(torch.device("cuda")) == "triton":
            prefetch_triton_start()

    def decoder_for(self, model: nn.Module) -> PlaneDecoder:
        """The plane decoder for this model: on the device its parameters live on."""
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
        try:
            return PlaneDecoder(device)
        except DecodeConfigError as exc:
            raise CsfLoadError(f"csf_loader: {exc}") from None

    def get_all_weights(
        self, model_config: ModelConfig, model: nn.Module
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        decoder = self.decoder_for(model)
        stream: Iterator[tuple[str, torch.Tensor]]
        if is_mxfp4_container(model_config.model):
            # Stock starts its "Loading weights took" timer in its own weight iterator, which a
            # container bypasses; without this the log reports the seconds since boot.
            if self.counter_before_loading_weights == 0.0:
                self.counter_before_loading_weights = time.perf_counter()
            stream = mxfp4_container_stream(Path(model_config.model), decoder)
        else:
            shard_of = shard_index(model_config.model)
            extent_of = tp_extent_resolver(model)
            stream = decode_csf_stream(super().get_all_weights(model_config, model), shard_of, extent_of, decoder)
        # With the Triton kernel and CSF_LOADER_READ_AHEAD=1 the stream's own work (checks, staging, launches)
        # runs on a thread ahead of stock's copies (read_ahead: slower than in line on the H100, 2026-12-05);
        # the torch codec on the host stays in line, on the worker's own cores.
        if decoder.batches and self.read_ahead:
            logger.info(
                "csf_loader: the weight stream is decoded on a thread ahead of stock's copies "
                "(CSF_LOADER_READ_AHEAD=1; 0, the default, keeps it in line)"
            )
            stream = read_ahead(stream, decoder.device)
        yield from stream

    def download_model(self, model_config: ModelConfig) -> None:
        if is_mxfp4_container(model_config.model):
            read_mxfp4_contract(Path(model_config.model))  # local only: validate at startup
            return
        super().download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        from vllm.distributed import get_tensor_model_parallel_world_size

        check_parallel_config()
        self.decoder_for(model)  # a bad CSF_LOADER_DECODE fails before any tensor is read
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
