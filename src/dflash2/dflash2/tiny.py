"""Tiny random DFlash drafters for a given target checkpoint (tests, demos).

`build_tiny_drafter(out, target)` writes a drafter stock vLLM loads as `DFlashDraftModel`
(`vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM`): Qwen3 decoder layers whose
context keys and values come from the target's auxiliary hidden states through `fc`, a mask token
for the query slots, and no embedding or LM head of its own (vLLM shares the target's). The
weights are random, so its drafts are rarely accepted; it exercises every code path of DFlash
speculation, not acceptance.

The directory appears complete or not at all (written next to `out`, then renamed).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


class TinyDrafterError(ValueError):
    """An impossible tiny-drafter request; the message names the field."""


def drafter_config(
    target_config: Mapping[str, Any],
    *,
    num_hidden_layers: int = 1,
    target_layer_ids: Sequence[int] | None = None,
    block_size: int = 4,
    causal: bool = True,
    extra_dflash_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The drafter's config.json for a target with `target_config` (the target's config.json)."""
    text = target_config.get("text_config", target_config)
    hidden = int(text["hidden_size"])
    layers = int(text["num_hidden_layers"])
    ids = list(target_layer_ids) if target_layer_ids is not None else sorted({0, layers - 1})
    bad = [i for i in ids if not 0 <= i < layers]
    if bad:
        raise TinyDrafterError(f"target_layer_ids: {bad} are not target layers 0..{layers - 1}")
    mask_token_id = text.get("pad_token_id", target_config.get("pad_token_id"))
    if mask_token_id is None:
        raise TinyDrafterError("target config: no pad_token_id to use as the drafter's mask token")
    dflash_config: dict[str, Any] = {
        "mask_token_id": int(mask_token_id),
        "target_layer_ids": ids,
        "causal": causal,
        **(extra_dflash_config or {}),
    }
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "vocab_size": int(text["vocab_size"]),
        "max_position_embeddings": int(text.get("max_position_embeddings", 4096)),
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "block_size": block_size,
        "dflash_config": dflash_config,
    }


def drafter_weights(config: Mapping[str, Any], *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the names DFlashQwen3ForCausalLM loads (no embedding, no LM head)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    num_aux = len(config["dflash_config"]["target_layer_ids"])

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    def norm(size: int) -> torch.Tensor:
        return (1.0 + torch.randn(size, generator=generator) * 0.1).to(torch.bfloat16)

    weights: dict[str, torch.Tensor] = {}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
        weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        weights[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = rand(hidden, inter)
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
    weights["fc.weight"] = rand(hidden, num_aux * hidden)
    weights["hidden_norm.weight"] = norm(hidden)
    weights["norm.weight"] = norm(hidden)
    return weights


def build_tiny_drafter(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    seed: int = 0,
    overwrite: bool = False,
    **config_options: Any,
) -> Path:
    """Write a tiny random DFlash drafter for the checkpoint in `target_dir` to `out_dir`."""
    from safetensors.torch import save_file

    out, target = Path(out_dir), Path(target_dir)
    if out.exists() and not overwrite:
        raise TinyDrafterError(f"out_dir: {out} already exists; pass overwrite=True to replace it")
    target_config = json.loads((target / "config.json").read_text())
    config = drafter_config(target_config, **config_options)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(drafter_weights(config, seed=seed), str(staging / "model.safetensors"))
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
