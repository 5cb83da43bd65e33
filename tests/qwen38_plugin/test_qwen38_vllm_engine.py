"""Stock vLLM (CPU) serving tiny Qwen4Exp checkpoints through the plugin's portable model:
greedy tokens follow transformers' greedy tokens, with several concurrent requests of mixed
lengths and chunked prefill (a step budget smaller than the prompts), in bf16 through the
`qwen3_8_flash_next_text` alias checkpoint.

The same in fp32, where the tokens must equal transformers' exactly, runs on the server of
test_qwen38_vllm_server.py (the engine arguments this module used: fp32, a 32-token step budget,
prefix caching on) and at TP=1 and TP=2 in test_qwen38_tp_engine.py (eager, preempted)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.engines import IN_PROCESS, run_engine_script
from tests.qwen38_plugin.qwen38_reference import (
    NEAR_TIE,
    assert_greedy_equal_until_near_tie,
    load_reference,
    reference_greedy_margins,
)

HERE = Path(__file__).resolve().parent
STEPS = 32
EOS = 248046


def run_engine(model: Path, dtype: str, prompts: list[list[int]], **llm_kwargs: Any) -> list[list[int]]:
    """Greedy tokens from a vLLM engine started in a subprocess (its engine core in that process)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **IN_PROCESS}
    args = [str(model), dtype, str(STEPS), json.dumps(prompts), json.dumps(llm_kwargs)]
    cmd = [sys.executable, str(HERE / "qwen38_engine_greedy.py"), *args]
    proc = run_engine_script(cmd, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = [line for line in proc.stdout.splitlines() if line.startswith('{"tokens"')]
    assert result, proc.stdout[-3000:] + proc.stderr[-6000:]
    tokens: list[list[int]] = json.loads(result[-1])["tokens"]
    return tokens


def reference_greedy(model: Path, prompts: list[list[int]], dtype: torch.dtype, steps: int = STEPS) -> list[list[int]]:
    hf = load_reference(model, dtype)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = hf.generate(ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(generated[0, len(prompt) :].tolist())
    return out


def mixed_prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # 1 token; shorter than a QSA block; longer than the QSA budget (16); longer than the
    # step budget below, so its prefill is split into chunks
    prompts = [torch.randint(0, 248_000, (n,), generator=gen).tolist() for n in (1, 3, 29, 70, 45)]
    prompts[3][33] = EOS
    return prompts


def test_bf16_alias_checkpoint_concurrent_chunked_prefill_follows_transformers(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    # The `qwen3_8_flash_next_text` spelling, served in bf16. Its weights are byte-identical to
    # the `qwen4_exp_text` checkpoint built from the same seed, which transformers loads natively:
    # that is the oracle. In bf16 vLLM's kernels (oneDNN GEMMs, the fused MoE) round in other
    # places than transformers' modules, so a continuation may part from transformers' where
    # transformers itself nearly ties; up to there, and in most continuations throughout, the
    # tokens are identical.
    alias, official = tiny_checkpoint("qwen3_8_flash_next_text"), tiny_checkpoint("qwen4_exp_text")
    assert json.loads((alias / "config.json").read_text())["model_type"] == "qwen3_8_flash_next_text"
    assert (alias / "model.safetensors").read_bytes() == (official / "model.safetensors").read_bytes()
    prompts = mixed_prompts(2)
    served = run_engine(alias, "bfloat16", prompts, max_num_batched_tokens=32, max_num_seqs=8)
    tokens, margins = reference_greedy_margins(official, prompts, STEPS, torch.bfloat16)
    identical = assert_greedy_equal_until_near_tie(served, tokens, margins, NEAR_TIE[torch.bfloat16])
    assert identical >= len(prompts) - 1, f"only {identical} of {len(prompts)} continuations identical"
