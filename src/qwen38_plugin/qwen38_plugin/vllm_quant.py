"""What the portable Qwen4Exp model does with vLLM's quantization config (``--quantization``).

Every linear layer the model builds from vLLM's layers takes vLLM's ``quant_config`` (the Gated
DeltaNet and QSA projections, the shared expert, the routed experts, the PLE projections), so any
method registered with vLLM applies to them; which ones a checkpoint quantizes is the method's
business (AWQ: ``modules_to_not_convert``, or every layer whose tensors are all floating point).
Two things are the model's own:

* **Fused modules.** vLLM hands the quantization config the ``packed_modules_mapping`` of the
  registered class (the dispatcher answers with stock's), and stock's Qwen4Exp fuses the QSA
  ``q_proj`` / ``k_proj`` / ``v_proj`` with ``indexer.index_qk_proj`` into one ``qkv_proj``. The
  portable model builds the indexer projection apart (unquantized), so with stock's mapping a
  checkpoint that quantizes q / k / v and keeps the indexer in fp16 (as AutoAWQ writes one) is
  refused by vLLM ("some but not all shards ... are quantized"). `configure_quantization` gives the
  config the portable model's own mapping (stock's other entries kept, for the multimodal model).
* **Plain-weight layers.** The hyper-connection mixers (``*hyper_connection*``: ``hc_norm``,
  ``input_mix_weight_down`` / ``_up``, ``block_inject_weight``) and the QSA indexer
  (``index_qk_proj`` and its norms) are read as plain weights by the model's fused kernels
  (`ops.hyper_connection`, `ops.qsa_paged`), so no quantization method can apply to them. A
  checkpoint that stores any of their tensors quantized (AWQ ``qweight`` / ``qzeros`` /
  ``scales``, an FP8 or NVFP4 ``weight`` with its scales, ...) fails at startup naming the layer
  and the fix (`check_plain_weight_layers`), instead of in the weight loader with a tensor name.

The MoE router ``mlp.gate`` and the ``shared_expert_gate`` are vLLM's Qwen3-Next MoE block's
(built unquantized there, as in stock's Qwen3-Next and Qwen4Exp). This module imports vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from vllm.config import VllmConfig

from qwen38_plugin.model import ConfigError

# A tensor of a plain-weight layer: (layer, what the layer is, the tensor's last name part).
_PLAIN_LAYER = re.compile(
    r"^(?P<layer>.*?(?:hyper_connection_mixer|_hyper_connection|\.indexer)(?:\.[A-Za-z_]+)?)\.(?P<part>[^.]+)$"
)
_PLAIN_DTYPES = ("F16", "BF16", "F32")
_FIXES = {
    "hyper_connection": (
        "the hyper-connection mixers",
        "hyper_connection",
        "ops.hyper_connection reads their weights unquantized",
    ),
    "indexer": ("the QSA indexer", "indexer", "the portable model builds it with quant_config=None"),
}


def configure_quantization(vllm_config: VllmConfig, packed_modules_mapping: Mapping[str, list[str]]) -> None:
    """Before the layers are built: the quantization config matches fused modules by the
    portable model's ``packed_modules_mapping``; a checkpoint that quantizes a plain-weight
    layer is refused (see the module docstring). Nothing without ``--quantization`` / a
    checkpoint ``quantization_config``."""
    quant_config = vllm_config.quant_config
    if quant_config is None:
        return
    # A new dict: the one there may be stock's class attribute, shared by reference.
    quant_config.packed_modules_mapping = {**quant_config.packed_modules_mapping, **packed_modules_mapping}
    if vllm_config.load_config.load_format == "dummy":
        return
    from vllm.transformers_utils.config import get_safetensors_params_metadata

    model_config = vllm_config.model_config
    metadata = get_safetensors_params_metadata(model_config.model, revision=model_config.revision)
    check_plain_weight_layers(metadata, quant_config.get_name())


def check_plain_weight_layers(metadata: Mapping[str, Mapping[str, Any]], method: str) -> None:
    """Raise `ConfigError` naming the first layer the portable model reads as plain weights whose
    checkpoint tensors (``metadata``: name -> safetensors header entry with its ``dtype``) are
    not plain fp16 / bf16 / fp32 ``weight`` tensors."""
    for name in sorted(metadata):
        if name.startswith("mtp."):
            continue  # the MTP drafter's layers are not built by this model
        match = _PLAIN_LAYER.match(name)
        if match is None:
            continue
        dtype = str(metadata[name].get("dtype", ""))
        if match["part"] == "weight" and dtype in _PLAIN_DTYPES:
            continue
        layer = match["layer"]
        kind = "indexer" if ".indexer" in layer else "hyper_connection"
        what, not_convert, why = _FIXES[kind]
        raise ConfigError(
            f"quantization ({method}): the checkpoint stores {name} ({dtype}), a quantized tensor of layer "
            f"{layer}, one of {what}, which the portable Qwen4Exp model reads as plain weights ({why}); "
            f"no quantization method applies to it. Quantize the checkpoint again leaving {what} in fp16 or "
            f"bf16 (AutoAWQ: add {not_convert!r} to modules_to_not_convert; llm-compressor / ModelOpt: add it "
            "to the ignore list)"
        )
