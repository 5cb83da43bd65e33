"""A tiny random Qwen3-MoE checkpoint (stock vLLM's `Qwen3MoeForCausalLM`) with the real tokenizer.

Stock vLLM's MXFP4 methods quantize MoE experts only, so the MXFP4-CSF engine test needs a
MoE model; the tokenizer is the one of the tiny checkpoint builder (qwen38_plugin.tiny).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from csf_loader.quantize import quantize_checkpoint

EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")  # qwen3_moe's router is `mlp.gate`


TINY: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    # 64 intermediate channels: at TP=2 each rank keeps 32, one whole MXFP4 block.
    "moe_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
}
# A larger one for GPU measurements (benchmarks/csf_loader/gpu_session.py): 768 expert planes.
SMALL: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


def build_tiny_qwen3_moe(out: Path, seed: int = 0, geometry: dict[str, Any] | None = None) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from qwen38_plugin.tiny.checkpoints import VOCAB_SIZE
    from qwen38_plugin.tiny.tokenizer import EOS_TOKEN, PAD_TOKEN, special_token_ids, write_tokenizer

    ids = special_token_ids()
    config = Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=VOCAB_SIZE,
        **(geometry or TINY),
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # HF starts norms at one; random values make every block visible
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape))
    model.save_pretrained(out, safe_serialization=True)
    generation = {"eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]], "pad_token_id": ids[PAD_TOKEN]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(out, model_max_length=4096)
    return out


def build_mxfp4_moe(root: Path) -> Path:
    """bf16 tiny Qwen3-MoE -> its routed experts quantized to standard MXFP4 (`quant_method: mxfp4`)."""
    bf16 = build_tiny_qwen3_moe(root / "qwen3_moe_bf16")
    mxfp4 = root / "qwen3_moe_mxfp4"
    quantize_checkpoint(bf16, mxfp4, "mxfp4", linear_suffixes=EXPERT_LINEARS)
    return mxfp4


def build_quantized_moes(root: Path, geometry: dict[str, Any] | None = None, device: str = "cpu") -> dict[str, Path]:
    """One bf16 Qwen3-MoE and its two quantized forms: ``nvfp4`` (every decoder linear, routed
    experts included, ModelOpt NVFP4) and ``mxfp4`` (the routed experts, OCP MXFP4)."""
    bf16 = build_tiny_qwen3_moe(root / "qwen3_moe_bf16", geometry=geometry)
    out = {"bf16": bf16, "nvfp4": root / "qwen3_moe_nvfp4", "mxfp4": root / "qwen3_moe_mxfp4"}
    quantize_checkpoint(bf16, out["nvfp4"], "nvfp4", device=device)
    quantize_checkpoint(bf16, out["mxfp4"], "mxfp4", linear_suffixes=EXPERT_LINEARS, device=device)
    return out
