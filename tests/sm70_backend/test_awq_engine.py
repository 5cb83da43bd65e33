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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import CACHE, build_cached_checkpoint
from tests.sm70_backend.awq_checkpoint import build_awq_pair

HERE = Path(__file__).parent
LOCK = "/tmp/qwen38-vllm.lock"  # engines on this machine run one at a time
TOL = 0.01


def source_checkpoint(model: str) -> Path:
    if model == "qwen3":
        return build_cached_checkpoint("qwen3", dtype="float16")
    from tests.csf_loader.tiny_moe import build_tiny_qwen3_moe

    out = CACHE / "awq_sm70" / "qwen3_moe-source"
    if not out.is_dir():
        build_tiny_qwen3_moe(out)
    return out


# (model, decoder layers x linear layers per layer, routed-expert layers)
MODELS = {"qwen3": (8, 0), "qwen3_moe": (4, 2)}


@pytest.fixture(scope="module", params=list(MODELS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = request.param
    source = source_checkpoint(model)
    awq_dir, fp16_dir = build_awq_pair(source, CACHE / "awq_sm70" / f"{model}-g32")
    out = tmp_path_factory.mktemp("awq_engine") / "engine.json"
    env = dict(
        os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0", VLLM_ALLOW_INSECURE_SERIALIZATION="1"
    )
    cmd = ["flock", LOCK, sys.executable, str(HERE / "awq_engine_run.py"), str(awq_dir), str(out)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    data: dict[str, Any] = json.loads(out.read_text())
    data["log"], data["fp16_dir"], data["source"], data["model"] = log, fp16_dir, source, model
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

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    worst = 0.0
    for request in served["requests"]:
        ids = request["prompt_ids"] + request["tokens"]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
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
