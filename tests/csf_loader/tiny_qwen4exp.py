"""A tiny Qwen3.8 Flash-Next (Qwen4Exp) quantized to standard NVFP4 (ModelOpt), for the CSF tests.

What is quantized: every linear layer of the portable model that takes NVFP4 through vLLM's
quantization config: the Gated DeltaNet projections ``in_proj_qkv`` / ``in_proj_z`` (vLLM's
``in_proj_qkvz``) and ``out_proj``, the QSA output ``o_proj``, the shared expert's
``gate_proj`` / ``up_proj`` / ``down_proj`` and the PLE ``key_proj`` / ``value_proj``, and, where
``routed_experts`` is set (CUDA only), the routed experts. Left in bf16 (in the config's
``ignore`` list), each for a reason:

* the routed experts on CPU: none of stock vLLM 0.32's NVFP4 MoE kernels runs on the CPU platform
  (its emulation backend runs Triton's GPU MoE kernel), so stock refuses the layer at startup with
  "No NvFp4 MoE backend supports the deployment configuration";
* the QSA ``q_proj`` / ``k_proj`` / ``v_proj``: stock's ``packed_modules_mapping`` for Qwen4Exp
  (which the dispatcher hands to vLLM's quantization config) fuses them with
  ``indexer.index_qk_proj``, so all four must share one precision, and the portable model builds
  the indexer projection unquantized (``quant_config=None``);
* ``in_proj_b`` / ``in_proj_a`` (6 output rows here, no 16-row NVFP4 block), the router, the
  shared-expert gate (one output), the indexer, embeddings, lm_head, hyper-connection mixers and
  the PLE tables, as in published ModelOpt checkpoints.
"""

from __future__ import annotations

from pathlib import Path

from csf_loader.quantize import quantize_checkpoint

QWEN4EXP_LINEARS = (
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "key_proj",
    "value_proj",
)
QSA_QKV = r"\.self_attn\.[qkv]_proj$"
ROUTED_EXPERTS = r"\.mlp\.experts\.\d+\."


def quantize_qwen4exp_nvfp4(bf16: Path, dst: Path, routed_experts: bool = False) -> list[str]:
    """``bf16`` (a tiny ``qwen4_exp_text`` checkpoint) quantized to NVFP4 into ``dst``; returns the
    quantized modules."""
    skip = QSA_QKV if routed_experts else f"{QSA_QKV}|{ROUTED_EXPERTS}"
    return quantize_checkpoint(bf16, dst, "nvfp4", linear_suffixes=QWEN4EXP_LINEARS, skip=skip)
