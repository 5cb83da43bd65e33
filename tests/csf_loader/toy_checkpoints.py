"""Toy FP4 checkpoints for the converter and loader tests (no model behind them; no pytest import,
so the GPU session's scripts can use them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from csf_loader.quantize import quantize_mxfp4, quantize_nvfp4


def make_nvfp4_moe(root: Path, seed: int = 0) -> Path:
    """Two shards, an index: 2 layers x 4 routed experts + a dense projection + a shared expert."""
    g = torch.Generator().manual_seed(seed)
    root.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for layer in range(2):
        out = shards[layer]
        out[f"model.layers.{layer}.input_layernorm.weight"] = torch.randn(64, generator=g).to(torch.bfloat16)
        projections = [
            f"model.layers.{layer}.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "down_proj")
        ]
        projections += [f"model.layers.{layer}.self_attn.o_proj", f"model.layers.{layer}.mlp.shared_expert.up_proj"]
        for module in projections:
            spread = torch.exp(torch.randn(48, 1, generator=g))
            q = quantize_nvfp4(torch.randn(48, 64, generator=g) * spread)
            out[module + ".weight"] = q["weight"]
            out[module + ".weight_scale"] = q["weight_scale"]
            out[module + ".weight_scale_2"] = q["weight_scale_2"].float()
            out[module + ".input_scale"] = torch.tensor(0.01)
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    (root / "config.json").write_text(json.dumps({"model_type": "toy_moe", "quantization_config": qc}))
    (root / "tokenizer.json").write_text("{}")
    return root


def make_mxfp4_moe(root: Path, cols_in: int = 96) -> Path:
    """MXFP4 experts: per-expert 2-D planes and one stacked 3-D plane; cols_in / 32 = 3 (not % 8)."""
    g = torch.Generator().manual_seed(1)
    root.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for layer in (1, 2):
        for e in range(3):
            q = quantize_mxfp4(torch.randn(32, cols_in, generator=g) * torch.exp(torch.randn(32, 1, generator=g)))
            tensors[f"model.layers.{layer}.mlp.experts.{e}.w1.weight"] = q["weight"]
            tensors[f"model.layers.{layer}.mlp.experts.{e}.w1.scale"] = q["scale"].view(torch.float8_e8m0fnu)
        q = quantize_mxfp4(torch.randn(3, 32, 256, generator=g))
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj_blocks"] = q["weight"]
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj_scales"] = q["scale"]
    tensors["model.layers.0.mlp.gate_proj.weight"] = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    qc = {"quant_method": "mxfp4"}
    (root / "config.json").write_text(json.dumps({"model_type": "toy_mx", "quantization_config": qc}))
    return root
