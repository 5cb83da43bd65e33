"""A tiny AWQ Qwen3 and a tiny AWQ Qwen3-MoE served by a real stock vLLM engine on CPU through the
SM70 AWQ method (every decoder linear layer and every routed expert quantized, group size 32).

What is honest on a CPU: the engine runs ``--quantization awq_sm70`` (asked for by name; on a
CPU stock's own AWQ path is chosen otherwise, see test_awq_config.py), so vLLM's model, weight
loaders (qkv / gate-up merging of AWQ shards; for the MoE model vLLM's MoE layer, its expert
weight loader and runner), our layers and the plain-torch reference run end to end. The CUDA
kernels do not run here (test_awq_cuda.py, on a GPU); that the method is chosen on compute
capability 7.x is shown on vLLM's config objects (test_awq_config.py).

Oracle: transformers (fp32) on the dequantized fp16 twin of the checkpoint, teacher-forced on
vLLM's prompt and greedy tokens. vLLM computes in fp16, so logprobs agree within fp16 tolerance
(0.01 absolute; measured 2026-11-30: 4e-4 dense, 7e-4 MoE), and each greedy token is the oracle's
argmax up to that. The same oracle on the unquantized original weights is off by more (measured:
0.08 dense, 0.07 MoE), so the check tells the dequantized model from the original.

The tiny Qwen3.8 Flash-Next (Qwen4Exp), quantized as an AutoAWQ Flash-Next (awq_checkpoint.py
says which layers and why), is served the same way by qwen38_plugin's portable model (one engine,
its core and worker in the script's process): every vLLM layer's quantization method is the SM70
AWQ one exactly where the checkpoint is quantized and unquantized elsewhere, the layers the fused
kernels read as plain weights (hyper-connection mixers, QSA indexer) hold fp16 weights, and the
logprobs equal the dequantized twin's by the same oracle.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import CACHE, build_cached_checkpoint, building
from tests.engines import IN_PROCESS, run_engine_script
from tests.sm70_backend.awq_checkpoint import (
    QWEN4EXP_NOT_CONVERTED,
    QWEN4EXP_QUANTIZED,
    build_awq_pair,
    quantization_config,
)

HERE = Path(__file__).parent
TOL = 0.01


def source_checkpoint(model: str) -> Path:
    if model == "qwen3":
        return build_cached_checkpoint("qwen3", dtype="float16")
    from tests.csf_loader.tiny_moe import build_tiny_qwen3_moe

    out = CACHE / "awq_sm70" / "qwen3_moe-source"
    with building(out):
        if not out.is_dir():
            build_tiny_qwen3_moe(out)
    return out


# (model, decoder layers x linear layers per layer, routed-expert layers)
MODELS = {"qwen3": (8, 0), "qwen3_moe": (4, 2)}


def run_engine(awq_dir: Path, tmp: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """awq_engine_run.py on ``awq_dir`` holding an engine core; its JSON plus the engine's log."""
    out = tmp / "engine.json"
    env = dict(
        os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        **(env or {}),
    )  # fmt: skip
    cmd = [sys.executable, str(HERE / "awq_engine_run.py"), str(awq_dir), str(out)]
    result = run_engine_script(cmd, env)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    data: dict[str, Any] = json.loads(out.read_text())
    data["log"] = log
    return data


@pytest.fixture(scope="module", params=list(MODELS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = request.param
    source = source_checkpoint(model)
    awq_dir, fp16_dir = build_awq_pair(source, CACHE / "awq_sm70" / f"{model}-g32")
    data = run_engine(awq_dir, tmp_path_factory.mktemp("awq_engine"))
    data["fp16_dir"], data["source"], data["model"] = fp16_dir, source, model
    return data


def test_vllm_chose_awq_sm70_for_every_decoder_linear_layer(served: dict[str, Any]) -> None:
    assert served["quantization"] == "awq_sm70"
    layers = {n: m for n, m in served["methods"].items() if ".layers." in n and not n.endswith("mlp.gate")}
    linear, moe = MODELS[served["model"]]
    assert sorted(layers.values()) == sorted(["Sm70AwqLinearMethod"] * linear + ["Sm70AwqMoEMethod"] * moe), layers
    assert "AWQ layers run through awq_sm70 (group size 32)" in served["log"]


def test_attention_layers_run_the_backend_asked_for(served: dict[str, Any]) -> None:
    # On a GPU run with SM70_ENGINE_ATTENTION_BACKEND=FLASH_ATTN_V100 (benchmarks/h200_session.sh s)
    # every attention layer must run our kernels; otherwise (CPU) the platform's own backend.
    impls = set(served["attention_impls"].values())
    decoder_layers = {name.split(".layers.")[1].split(".")[0] for name in served["methods"] if ".layers." in name}
    assert len(served["attention_impls"]) == len(decoder_layers) > 0, served["attention_impls"]
    asked = os.environ.get("SM70_ENGINE_ATTENTION_BACKEND")
    if asked == "FLASH_ATTN_V100":
        assert impls == {"FlashAttnV100Impl"}, impls
    else:
        assert len(impls) == 1 and "V100" not in next(iter(impls)), impls


def worst_logprob_error(served: dict[str, Any], checkpoint: Path, check_greedy: bool) -> float:
    from transformers import AutoModelForCausalLM

    # On a GPU machine the oracle runs there: transformers' Qwen4Exp hands its delta rule to fla-core's
    # Triton kernels whenever fla-core is installed, and those refuse CPU tensors.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    worst = 0.0
    for request in served["requests"]:
        ids = request["prompt_ids"] + request["tokens"]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids], device=device)).logits[0].float(), -1).cpu()
        n = len(request["prompt_ids"])
        for i in range(1, n):  # prompt logprobs: of token i given tokens < i
            got, want = request["prompt_logprobs"][i], float(logprobs[i - 1, ids[i]])
            worst = max(worst, abs(got - want))
        for j, token in enumerate(request["tokens"]):
            row = logprobs[n + j - 1]
            worst = max(worst, abs(request["logprobs"][j] - float(row[token])))
            if check_greedy:
                assert float(row[token]) >= float(row.max()) - TOL, "greedy token is not the oracle's argmax"
    return worst


def test_logprobs_equal_the_dequantized_fp16_model(served: dict[str, Any]) -> None:
    assert worst_logprob_error(served, served["fp16_dir"], check_greedy=True) <= TOL
    assert worst_logprob_error(served, served["source"], check_greedy=False) > TOL  # before AWQ quantization


# -- Qwen3.8 Flash-Next (Qwen4Exp) on the portable model ------------------------------------------
AWQ, MOE, PLAIN = "Sm70AwqLinearMethod", "Sm70AwqMoEMethod", "UnquantizedLinearMethod"


@pytest.fixture(scope="module")
def served_qwen4exp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny Qwen4Exp quantized as an AutoAWQ Flash-Next (awq_checkpoint.py says which layers),
    served once by the portable model (engine core and worker in the script's process)."""
    source = build_cached_checkpoint("qwen4_exp_text", dtype="float16")
    qconfig = quantization_config(32, modules_to_not_convert=QWEN4EXP_NOT_CONVERTED)
    awq_dir, fp16_dir = build_awq_pair(
        source, CACHE / "awq_sm70" / f"{source.name}-g32", qconfig=qconfig, quantize=QWEN4EXP_QUANTIZED
    )
    data = run_engine(awq_dir, tmp_path_factory.mktemp("awq_qwen4exp"), IN_PROCESS)
    data["fp16_dir"], data["source"] = fp16_dir, source
    data["config"] = json.loads((source / "config.json").read_text())
    return data


def qwen4exp_expected_methods(config: dict[str, Any]) -> dict[str, str]:
    """The quantization method of every vLLM layer of the portable model for the AWQ checkpoint."""
    expected = {"model.embed_tokens": "UnquantizedEmbeddingMethod", "lm_head": "UnquantizedEmbeddingMethod"}
    ple_layers = {i - 1 for i in config["ple_layer_ids"]}
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}"
        if kind == "linear_attention":
            expected |= {f"{p}.linear_attn.in_proj_qkvz": AWQ, f"{p}.linear_attn.out_proj": AWQ,
                         f"{p}.linear_attn.in_proj_ba": PLAIN, f"{p}.linear_attn.conv1d": PLAIN}  # fmt: skip
        else:
            expected |= {f"{p}.self_attn.qkv_proj": AWQ, f"{p}.self_attn.o_proj": AWQ,
                         f"{p}.self_attn.indexer.index_qk_proj": PLAIN}  # fmt: skip
        expected |= {f"{p}.mlp.gate": PLAIN, f"{p}.mlp.shared_expert_gate": PLAIN,
                     f"{p}.mlp.shared_expert.gate_up_proj": AWQ, f"{p}.mlp.shared_expert.down_proj": AWQ,
                     f"{p}.mlp.experts.routed_experts": MOE}  # fmt: skip
        if i in ple_layers:
            expected |= {f"{p}.ple.key_proj": AWQ, f"{p}.ple.value_proj": AWQ}
    return expected


def test_qwen4exp_quantized_layers_run_awq_sm70_and_the_others_stay_plain(served_qwen4exp: dict[str, Any]) -> None:
    run = served_qwen4exp
    assert run["quantization"] == "awq_sm70"
    assert "portable (qwen38_plugin) implementation" in run["log"]
    assert run["methods"] == qwen4exp_expected_methods(run["config"])
    params = run["parameters"]
    # The layers the fused kernels read as plain weights hold fp16 weights, nothing quantized.
    plain = {n: d for n, d in params.items() if "hyper_connection" in n or ".indexer." in n}
    # Two mixers a layer (4 weights each), the final mixer (3), the indexer (projection and 2 norms).
    assert len(plain) == 4 * 2 * 4 + 3 + 3, sorted(plain)
    assert all(n.endswith(".weight") and d == "float16" for n, d in plain.items()), plain
    assert params["model.layers.0.linear_attn.in_proj_qkvz.qweight"] == "int32"
    assert params["model.layers.3.mlp.experts.routed_experts.w13_qweight"] == "int32"


def test_qwen4exp_logprobs_equal_the_dequantized_fp16_model(served_qwen4exp: dict[str, Any]) -> None:
    # Measured 2026-11-30: 1.5e-4 from the dequantized model, 0.011 from the original weights.
    dequantized = worst_logprob_error(served_qwen4exp, served_qwen4exp["fp16_dir"], check_greedy=True)
    original = worst_logprob_error(served_qwen4exp, served_qwen4exp["source"], check_greedy=False)
    assert dequantized <= TOL
    assert original > max(10 * dequantized, TOL / 2), (original, dequantized)  # before AWQ quantization
