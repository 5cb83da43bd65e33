"""AWQ W4A16 on SM70: a vLLM quantization method for dense linear layers and MoE experts.

Registration (`sm70_backend._registration.register_awq`): ``register_quantization_config`` under a
new name, ``awq_sm70``; stock's ``awq`` stays stock's. vLLM's ``ModelConfig._verify_quantization``
asks every registered method's ``override_quantization_method`` before the built-in AWQ overrides
(``config/model.py``: custom names are placed first), so `Sm70AwqConfig` claims an AWQ checkpoint
(``quant_method: awq``) when, and only when:
- the device has compute capability 7.x (the SM70 platform's ``get_device_capability``), and the
  user asked for no method or for ``awq`` / ``auto_awq`` / ``awq_marlin``; or
- the user asked for it by name (``--quantization awq_sm70``), on any device: on a CPU this runs
  the plain-torch reference (how the CPU tests serve an AWQ checkpoint through it).
Everywhere else it returns None and stock's AWQ path is chosen exactly as without the plugin.
Overwriting ``awq`` itself (also allowed by the registry) was not needed and would replace
stock's AWQ on every device.

Layers: `Sm70AwqLinearMethod` (AWQ's checkpoint tensors ``qweight`` / ``qzeros`` / ``scales`` as
stock creates them) and `Sm70AwqMoEMethod` (stock's AWQ MoE layout: ``w13_*`` gate then up,
``w2_*``), both running `kernels.awq` (CUDA kernels on a GPU, the reference elsewhere).
Unsupported bits, group sizes, dtypes or shapes fail when the config or layer is built, naming
the supported set. ``reload_weights`` / weight transfer on these layers is refused before any
tensor changes (`refuse_reload`, called by `sm70_backend.worker.Sm70Worker`; R25 / R55).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.fused_moe import (
    FusedMoEMethodBase,
    FusedMoeWeightScaleSupported,
    RoutedExperts,
    UnquantizedFusedMoEMethod,
)
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter
from vllm.model_executor.utils import set_weight_attrs

from sm70_backend.kernels import awq as ops

QUANT_NAME = "awq_sm70"
# `--quantization` values under which an AWQ checkpoint is ours on compute capability 7.x.
CLAIMED_USER_METHODS = (None, "awq", "auto_awq", "awq_marlin", QUANT_NAME)

logger = logging.getLogger("vllm.plugins.sm70_backend")
_announced: list[bool] = []


class Sm70AwqReloadError(RuntimeError):
    pass


def device_major() -> int | None:
    """Major compute capability of the current platform (None on a CPU), read when asked."""
    from vllm import platforms

    capability = platforms.current_platform.get_device_capability()
    return None if capability is None else int(capability.major)


class Sm70AwqConfig(QuantizationConfig):
    """AWQ (4-bit, zero point, group size 32 / 64 / 128) with fp16 activations on SM70."""

    def __init__(
        self,
        weight_bits: int,
        group_size: int,
        zero_point: bool,
        lm_head_quantized: bool = False,
        modules_to_not_convert: list[str] | None = None,
    ) -> None:
        super().__init__()
        ops.check_config(weight_bits, group_size, zero_point)
        self.weight_bits = weight_bits
        self.group_size = group_size
        self.zero_point = zero_point
        self.lm_head_quantized = lm_head_quantized
        self.modules_to_not_convert = modules_to_not_convert or []
        self.pack_factor = 32 // weight_bits

    def __repr__(self) -> str:
        return (
            f"Sm70AwqConfig(weight_bits={self.weight_bits}, group_size={self.group_size}, "
            f"zero_point={self.zero_point}, modules_to_not_convert={self.modules_to_not_convert})"
        )

    @classmethod
    def get_name(cls) -> Any:  # stock types this as a Literal of its own names
        return QUANT_NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return list(ops.SUPPORTED_DTYPES)

    @classmethod
    def get_min_capability(cls) -> int:
        return 70

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        return ["quant_config.json", "quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Sm70AwqConfig:
        return cls(
            weight_bits=cls.get_from_keys(config, ["w_bit", "bits"]),
            group_size=cls.get_from_keys(config, ["q_group_size", "group_size"]),
            zero_point=cls.get_from_keys(config, ["zero_point"]),
            lm_head_quantized=cls.get_from_keys_or(config, ["lm_head"], default=False),
            modules_to_not_convert=cls.get_from_keys_or(config, ["modules_to_not_convert"], None),
        )

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: Any, hf_config: Any = None) -> Any:
        if not isinstance(hf_quant_cfg, dict) or str(hf_quant_cfg.get("quant_method", "")).lower() != "awq":
            return None
        if user_quant == QUANT_NAME:
            return QUANT_NAME
        if user_quant in CLAIMED_USER_METHODS and device_major() == 7:
            return QUANT_NAME
        return None

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        if self.modules_to_not_convert:
            self.modules_to_not_convert = hf_to_vllm_mapper.apply_list(self.modules_to_not_convert)

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        """As stock's AWQ: without ``modules_to_not_convert``, every layer whose checkpoint tensors are
        all floating point (e.g. a MoE router ``mlp.gate``) stays unquantized, except a module that
        holds quantized layers itself: a Gated DeltaNet layer's own ``A_log`` / ``dt_bias`` make
        ``...linear_attn`` a floating-point "layer", which (layers match by substring) would
        otherwise leave its quantized ``in_proj_qkvz`` / ``out_proj`` unquantized and their
        ``qweight`` unloadable (stock's AWQ configs list it, vLLM 0.32)."""
        if self.modules_to_not_convert:
            return
        from vllm.transformers_utils.config import get_safetensors_params_metadata

        metadata = get_safetensors_params_metadata(model_name, revision=revision)
        self.modules_to_not_convert = floating_point_layers(metadata)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        if isinstance(layer, LinearBase | RoutedExperts) and not _announced:
            _announced.append(True)
            logger.info(
                "sm70_backend: AWQ layers run through %s (group size %d): CUDA kernels on a GPU, the plain-torch "
                "reference elsewhere",
                QUANT_NAME,
                self.group_size,
            )
        if isinstance(layer, LinearBase):
            if is_layer_skipped(
                prefix, self.modules_to_not_convert, self.packed_modules_mapping, match_mode="substring"
            ):
                return UnquantizedLinearMethod()
            return Sm70AwqLinearMethod(self, prefix)
        if isinstance(layer, RoutedExperts):
            if is_layer_skipped(prefix, self.modules_to_not_convert, match_mode="substring"):
                return UnquantizedFusedMoEMethod(layer.moe_config)
            return Sm70AwqMoEMethod(self, layer.moe_config, prefix)
        return None


def floating_point_layers(metadata: dict[str, Any]) -> list[str]:
    """The layers (tensor names less their last part) of a checkpoint's safetensors ``metadata``
    whose tensors are all fp16 / bf16 / fp32 and none of whose sublayers holds another dtype."""
    from safetensors.torch import _TYPES

    floating = (torch.float16, torch.bfloat16, torch.float32)
    layers = {name.rsplit(".", 1)[0] for name in metadata}
    quantized = {
        name.rsplit(".", 1)[0]
        for name, info in metadata.items()
        if (dtype := info.get("dtype")) and _TYPES[dtype] not in floating
    }
    holding_quantized = {layer.rsplit(".", n)[0] for layer in quantized for n in range(layer.count(".") + 1)}
    return sorted(layers - holding_quantized)


def _check_dtype(params_dtype: torch.dtype, prefix: str) -> None:
    if params_dtype not in ops.SUPPORTED_DTYPES:
        raise ValueError(
            f"SM70 AWQ: layer {prefix or '?'} would run in {params_dtype}; supported: torch.float16 "
            f"(run with --dtype float16)"
        )


def _mark_loaded(layer: torch.nn.Module, prefix: str) -> None:
    """Second line of R55: a second weight processing of the same layer (an in-place reload that
    bypassed `Sm70Worker`) fails loudly; the first line, `refuse_reload`, fails before any change."""
    if getattr(layer, "_sm70_awq_loaded", False):
        raise Sm70AwqReloadError(
            f"SM70 AWQ: layer {prefix or '?'} was already loaded; reloading AWQ weights in place is not supported "
            f"on SM70. Restart vLLM with the new checkpoint."
        )
    layer._sm70_awq_loaded = True  # type: ignore[assignment]


def refuse_reload(model: torch.nn.Module, what: str = "reload_weights") -> None:
    """Raise `Sm70AwqReloadError` if ``model`` has SM70 AWQ layers. Reads module attributes only."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), Sm70AwqLinearMethod | Sm70AwqMoEMethod):
            raise Sm70AwqReloadError(
                f"SM70 AWQ: {what} is not supported for AWQ layers on SM70 (first: {name}); nothing was changed. "
                f"Restart vLLM with the new checkpoint."
            )


class Sm70AwqLinearMethod(LinearMethodBase):
    def __init__(self, quant_config: Sm70AwqConfig, prefix: str = "") -> None:
        self.quant_config = quant_config
        self.prefix = prefix

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        _check_dtype(params_dtype, self.prefix)
        group_size = self.quant_config.group_size
        pack = self.quant_config.pack_factor
        output_size_per_partition = sum(output_partition_sizes)
        ops.check_shape(input_size_per_partition, output_size_per_partition, group_size, f"layer {self.prefix}")
        for size in output_partition_sizes:
            ops.check_shape(input_size_per_partition, size, group_size, f"a part of layer {self.prefix}")
        weight_loader = extra_weight_attrs.get("weight_loader")
        num_groups = input_size_per_partition // group_size
        qweight = PackedvLLMParameter(
            data=torch.empty(input_size_per_partition, output_size_per_partition // pack, dtype=torch.int32),
            input_dim=0,
            output_dim=1,
            packed_dim=1,
            packed_factor=pack,
            weight_loader=weight_loader,
        )
        qzeros = PackedvLLMParameter(
            data=torch.empty(num_groups, output_size_per_partition // pack, dtype=torch.int32),
            input_dim=0,
            output_dim=1,
            packed_dim=1,
            packed_factor=pack,
            weight_loader=weight_loader,
        )
        scales = GroupQuantScaleParameter(
            data=torch.empty(num_groups, output_size_per_partition, dtype=params_dtype),
            input_dim=0,
            output_dim=1,
            weight_loader=weight_loader,
        )
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)

    def process_weights_after_loading(self, layer: Any) -> None:
        _mark_loaded(layer, self.prefix)
        for name in ("qweight", "qzeros", "scales"):
            setattr(layer, name, Parameter(getattr(layer, name).data.contiguous(), requires_grad=False))
        ops.prepare(layer.qweight.device)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out_features = layer.qweight.shape[1] * self.quant_config.pack_factor
        x2 = x.reshape(-1, x.shape[-1])
        out = ops.awq_linear_op(x2, layer.qweight, layer.qzeros, layer.scales)  # opaque to torch.compile
        if bias is not None:
            out.add_(bias)
        return out.reshape(*x.shape[:-1], out_features)


class Sm70AwqMoEMethod(FusedMoEMethodBase):
    """AWQ experts in stock's AWQ MoE layout (``w13_qweight [E, H, 2I/8]`` ...), SiLU-gated."""

    def __init__(self, quant_config: Sm70AwqConfig, moe: Any, prefix: str = "") -> None:
        super().__init__(moe)
        self.quant_config = quant_config
        self.prefix = prefix
        if moe.activation != MoEActivation.SILU:
            raise ValueError(
                f"SM70 AWQ MoE: layer {prefix or '?'} uses activation {moe.activation}; supported: silu (SiLU and mul)"
            )
        if getattr(moe, "has_bias", False):
            raise ValueError(f"SM70 AWQ MoE: layer {prefix or '?'} has expert biases; supported: no bias")

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        _check_dtype(params_dtype, self.prefix)
        group_size = self.quant_config.group_size
        pack = self.quant_config.pack_factor
        shards = self.moe.w13_num_shards
        ops.check_shape(hidden_size, shards * intermediate_size_per_partition, group_size, f"experts {self.prefix} w13")
        ops.check_shape(intermediate_size_per_partition, hidden_size, group_size, f"experts {self.prefix} w2")
        extra_weight_attrs.update({"is_transposed": True, "quant_method": FusedMoeWeightScaleSupported.GROUP.value})
        inter = intermediate_size_per_partition
        shapes = {
            "w13_qweight": ((num_experts, hidden_size, shards * inter // pack), torch.int32),
            "w2_qweight": ((num_experts, inter, hidden_size // pack), torch.int32),
            "w13_scales": ((num_experts, hidden_size // group_size, shards * inter), params_dtype),
            "w2_scales": ((num_experts, inter // group_size, hidden_size), params_dtype),
            "w13_qzeros": ((num_experts, hidden_size // group_size, shards * inter // pack), torch.int32),
            "w2_qzeros": ((num_experts, inter // group_size, hidden_size // pack), torch.int32),
        }
        for name, (shape, dtype) in shapes.items():
            param = Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)

    def get_fused_moe_quant_config(self, layer: Any) -> None:
        return None

    def process_weights_after_loading(self, layer: Any) -> None:
        _mark_loaded(layer, self.prefix)
        for name in ("w13_qweight", "w13_qzeros", "w13_scales", "w2_qweight", "w2_qzeros", "w2_scales"):
            setattr(layer, name, Parameter(getattr(layer, name).data.contiguous(), requires_grad=False))
        ops.prepare(layer.w13_qweight.device)

    def apply(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        # Shared experts are run by vLLM's MoE runner (this method has no modular kernel).
        ids = topk_ids
        expert_map = getattr(layer, "expert_map", None)
        if expert_map is not None:
            ids = expert_map[topk_ids.long()]  # global -> local expert, -1 elsewhere (dropped)
        return ops.awq_moe(
            x,
            ops.AwqExperts(layer.w13_qweight, layer.w13_qzeros, layer.w13_scales),
            ops.AwqExperts(layer.w2_qweight, layer.w2_qzeros, layer.w2_scales),
            topk_weights,
            ids,
            bool(getattr(layer, "apply_router_weight_on_input", False)),
        )
