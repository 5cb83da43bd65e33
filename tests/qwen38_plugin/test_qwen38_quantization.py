"""The portable Qwen4Exp model under vLLM's quantization config (`vllm_quant`), with AWQ checkpoints
of the tiny Qwen4Exp built as tests/sm70_backend/awq_checkpoint.py builds them.

Through stock vLLM's model loader at startup (``load_only.py``: the model built and its weights
loaded as an engine's worker does, in one process for all four checkpoints; on CPU through
``--quantization awq_sm70``):

* an AWQ checkpoint as AutoAWQ writes one (``modules_to_not_convert`` listing the indexer, the
  gates, the hyper-connection mixers) loads: before the portable model gave the quantization
  config its own ``packed_modules_mapping``, stock's (which fuses the indexer into ``qkv_proj``)
  made vLLM refuse it ("some but not all shards of ...qkv_proj are quantized");
* the same without ``modules_to_not_convert`` loads (the SM70 AWQ config then derives the list
  from the checkpoint's dtypes);
* a checkpoint that quantizes the hyper-connection mixers, or the QSA indexer, fails when the
  model is built, naming the layer and the fix (before: the weight loader's "no module or
  parameter named ...qweight", or the shard error above).

That the loaded AWQ model serves the dequantized model's logprobs is test_awq_engine.py's
(sm70_backend) engine test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CACHE, build_cached_checkpoint
from tests.sm70_backend.awq_checkpoint import (
    QWEN4EXP_NOT_CONVERTED,
    QWEN4EXP_QUANTIZED,
    build_awq_pair,
    quantization_config,
)

LOAD_ONLY = Path(__file__).parents[1] / "csf_loader" / "load_only.py"
HC_DOWN = r"|_hyper_connection\.input_mix_weight_down\.weight$"
INDEXER = r"|\.indexer\.index_qk_proj\.weight$"


def awq_checkpoint(name: str, quantize: str, not_convert: list[str] | None) -> Path:
    source = build_cached_checkpoint("qwen4_exp_text", dtype="float16")
    qconfig = quantization_config(32, **({} if not_convert is None else {"modules_to_not_convert": not_convert}))
    out = CACHE / "awq_sm70" / f"{source.name}-{name}"
    awq_dir, _ = build_awq_pair(source, out, qconfig=qconfig, quantize=quantize)
    return awq_dir


@pytest.fixture(scope="module")
def loads() -> dict[str, dict[str, Any]]:
    models = {
        "autoawq": awq_checkpoint("g32", QWEN4EXP_QUANTIZED, QWEN4EXP_NOT_CONVERTED),
        "derived": awq_checkpoint("g32-derived", QWEN4EXP_QUANTIZED, None),
        "mixers": awq_checkpoint("g32-mixers", QWEN4EXP_QUANTIZED + HC_DOWN, None),
        "indexer": awq_checkpoint(
            "g32-indexer", QWEN4EXP_QUANTIZED + INDEXER, [m for m in QWEN4EXP_NOT_CONVERTED if m != "indexer"]
        ),
    }
    cmd = [sys.executable, str(LOAD_ONLY), "auto", "quantization=awq_sm70", *map(str, models.values())]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"model"')]
    assert len(lines) == len(models), result.stdout[-3000:] + result.stderr[-3000:]
    return dict(zip(models, lines, strict=True))


def test_awq_checkpoints_with_plain_indexer_and_mixers_load(loads: dict[str, dict[str, Any]]) -> None:
    for name in ("autoawq", "derived"):
        assert loads[name].get("loaded") is True, loads[name]


def test_quantized_mixers_fail_at_startup_naming_the_layer_and_the_fix(loads: dict[str, dict[str, Any]]) -> None:
    error = loads["mixers"].get("error", "")
    assert error.startswith("ConfigError: quantization (awq_sm70): the checkpoint stores "), error
    assert "layer model.layers.0.attn_hyper_connection.input_mix_weight_down, one of the hyper-connection" in error
    assert "add 'hyper_connection' to modules_to_not_convert" in error


def test_quantized_indexer_fails_at_startup_naming_the_layer_and_the_fix(loads: dict[str, dict[str, Any]]) -> None:
    error = loads["indexer"].get("error", "")
    assert error.startswith("ConfigError: quantization (awq_sm70): the checkpoint stores "), error
    assert "layer model.layers.3.self_attn.indexer.index_qk_proj, one of the QSA indexer" in error
    assert "add 'indexer' to modules_to_not_convert" in error


def test_plain_weight_check_reads_dtypes_and_names() -> None:
    """`check_plain_weight_layers` on safetensors metadata: plain fp16 / bf16 / fp32 weights pass,
    an FP8 weight or a scale fails, the MTP drafter's layers are not this model's."""
    from qwen38_plugin.model import ConfigError
    from qwen38_plugin.vllm_quant import check_plain_weight_layers

    plain = {
        "model.hyper_connection_mixer.hc_norm.weight": {"dtype": "F32"},
        "model.layers.0.mlp_hyper_connection.block_inject_weight.weight": {"dtype": "BF16"},
        "model.layers.3.self_attn.indexer.k_layernorm.weight": {"dtype": "F16"},
        "model.layers.0.linear_attn.in_proj_qkv.qweight": {"dtype": "I32"},  # not a plain-weight layer
        "mtp.layers.0.attn_hyper_connection.input_mix_weight_up.weight_scale": {"dtype": "F32"},
    }
    check_plain_weight_layers(plain, "fp8")
    fp8 = {**plain, "model.layers.7.self_attn.indexer.index_qk_proj.weight": {"dtype": "F8_E4M3"}}
    with pytest.raises(ConfigError, match=r"stores model\.layers\.7\.self_attn\.indexer\.index_qk_proj\.weight "):
        check_plain_weight_layers(fp8, "fp8")
    scale = {**plain, "model.hyper_connection_mixer.input_mix_weight_up.weight_scale": {"dtype": "F32"}}
    with pytest.raises(ConfigError, match=r"layer model\.hyper_connection_mixer\.input_mix_weight_up, one of "):
        check_plain_weight_layers(scale, "modelopt")
