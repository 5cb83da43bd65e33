"""The portable model (ops composed into layers, streaming states) against transformers'
Qwen4ExpForCausalLM on tiny random checkpoints: logits of the prompt's last position and
32 greedy tokens, for several configurations, a batch of mixed-length prompts run together."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from qwen38_plugin.model import (
    CheckpointError,
    ConfigError,
    Qwen4ExpCore,
    check_tensor_parallel,
    greedy_generate,
    iter_safetensors,
)
from tests.qwen38_plugin.qwen38_reference import assert_fp32_equals_reference, load_reference, rel_err

EOS = 248046

NO_QSA: dict[str, Any] = {
    "layer_types": ["linear_attention"] * 4,
    **dict.fromkeys(
        ["indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio"]
    ),
}

CONFIGS: dict[str, dict[str, Any]] = {
    # every block: GDN, QSA (budget 16, ratio 4), hc_count 4, PLE on layers 1-2
    "default": {},
    # two streams, no PLE
    "hc2-no-ple": {"hc_count": 2, "ple_layer_ids": []},
    # a smaller budget and compress ratio, PLE on a single layer, sigmoid output gate
    "budget8-ratio2": {"indexer_budget": 8, "indexer_compress_ratio": 2, "ple_layer_ids": [3]},
    # a compress ratio that does not divide the CPU's default block size (the engine test's model)
    "budget12-ratio3": {"indexer_budget": 12, "indexer_compress_ratio": 3},
    # without QSA: transformers builds every attention layer with an indexer, so the model
    # without QSA is the one without attention layers (every layer Gated DeltaNet, no indexer)
    "no-qsa": NO_QSA,
}


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # mixed lengths: one token, shorter than a QSA block, and well beyond the budget
    prompts = [torch.randint(0, 248_000, (n,), generator=gen).tolist() for n in (1, 6, 45)]
    prompts[2][20] = EOS  # an EOS inside the prompt resets the n-gram context
    return prompts


def _load_core(path: Path, dtype: torch.dtype) -> Qwen4ExpCore:
    core = Qwen4ExpCore(AutoConfig.from_pretrained(path)).to(dtype)
    core.load_checkpoint_tensors(iter_safetensors(path))
    return core.eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_logits_and_greedy_tokens_equal_transformers(tiny_checkpoint: Callable[..., Path], name: str) -> None:
    path = tiny_checkpoint("qwen4_exp_text", overrides=CONFIGS[name])
    assert_fp32_equals_reference(
        load_reference(path, torch.float32), _load_core(path, torch.float32), _prompts(len(name))
    )


# bf16/fp16: both sides round every intermediate to the half format, at slightly different points
# (fused vs unfused projections, attention accumulation order); logits agree to a few percent of
# their range, so tokens may legitimately diverge after a near-tie: we check the logits only.
HALF_LOGIT_TOL = {torch.bfloat16: 5e-2, torch.float16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_match_transformers(tiny_checkpoint: Callable[..., Path], dtype: torch.dtype) -> None:
    path = tiny_checkpoint("qwen4_exp_text")
    hf, core = load_reference(path, dtype), _load_core(path, dtype)
    prompts = _prompts(7)
    with torch.no_grad():
        _, first_logits = greedy_generate(core, prompts, 1)
        for prompt, logits in zip(prompts, first_logits, strict=True):
            expected = hf(torch.tensor([prompt])).logits[0, -1]
            assert rel_err(logits, expected) < HALF_LOGIT_TOL[dtype]


def test_alias_model_type_loads_identically(tiny_checkpoint: Callable[..., Path]) -> None:
    from qwen38_plugin.configs import register_alias_configs

    register_alias_configs()

    official, alias = tiny_checkpoint("qwen4_exp_text"), tiny_checkpoint("qwen3_8_flash_next_text")
    # the alias class (its instances report the official model_type, see qwen38_plugin.configs)
    assert type(AutoConfig.from_pretrained(alias)).model_type == "qwen3_8_flash_next_text"
    prompts = _prompts(3)
    with torch.no_grad():
        a = greedy_generate(_load_core(official, torch.float32), prompts, 4)
        b = greedy_generate(_load_core(alias, torch.float32), prompts, 4)
    assert a[0] == b[0]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"indexer_kv_heads": 2}, "indexer_kv_heads"),
        ({"indexer_budget": 10}, "indexer_budget"),
        (
            {"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "indexed_attention"]},
            "layer_types",
        ),
    ],
)
def test_unsupported_configs_fail_naming_the_field(
    tiny_checkpoint: Callable[..., Path], overrides: dict[str, Any], field: str
) -> None:
    config = AutoConfig.from_pretrained(tiny_checkpoint("qwen4_exp_text"))
    for key, value in overrides.items():
        object.__setattr__(config, key, value)  # bypass transformers' own validation: test ours
    with pytest.raises(ConfigError, match=field):
        Qwen4ExpCore(config)


def test_missing_and_unexpected_tensors_are_named(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("qwen4_exp_text")
    core = Qwen4ExpCore(AutoConfig.from_pretrained(path))
    tensors = [
        (name, t)
        for name, t in iter_safetensors(path)
        if name
        not in ("model.layers.3.self_attn.indexer.k_layernorm.weight", "model.layers.2.mlp.experts.5.up_proj.weight")
    ]
    tensors.append(("model.layers.0.self_attn.q_proj.weight", torch.zeros(512, 64)))
    with pytest.raises(CheckpointError) as err:
        core.load_checkpoint_tensors(tensors)
    message = str(err.value)
    assert "model.layers.3.self_attn.indexer.k_layernorm.weight" in message
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in message
    assert "model.layers.0.self_attn.q_proj.weight" in message
    assert err.value.unexpected == ["model.layers.0.self_attn.q_proj.weight"]


def test_tensor_parallel_geometry_is_checked() -> None:
    from types import SimpleNamespace

    flash_next = SimpleNamespace(
        num_attention_heads=24, num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=48,
        num_experts=512, moe_intermediate_size=512, shared_expert_intermediate_size=512, ple_layer_ids=[1],
        make_ngram_vocab_size_divisible_by=128, vocab_size=248320,
    )  # fmt: skip
    for tp in (1, 2, 4, 8):
        check_tensor_parallel(flash_next, tp)
    with pytest.raises(ConfigError, match="linear_num_key_heads: 16 heads cannot be split over tensor_parallel_size=3"):
        check_tensor_parallel(flash_next, 3)
    with pytest.raises(ConfigError, match="num_attention_heads: 24 heads"):
        check_tensor_parallel(flash_next, 16)
