"""The portable model's verify path in a real vLLM engine on CPU: greedy output with vLLM's n-gram
proposer (1 and 4 speculative tokens) equals transformers' greedy output (which the engine gives
without speculation, bit for bit in fp32: test_qwen38_vllm_engine.py), for concurrent requests of
mixed lengths whose chunked prefills share steps with verify rows.

The dispatcher still refuses ``--speculative-config`` for the portable model (it has no MTP drafter
yet), so the engine script lifts the refusal for n-gram in its own process (`qwen38_engine_verify`).
On the tiny random checkpoint the n-gram proposer's drafts are (almost) never right: what this
proves is the verify rows and their rollback through vLLM's real GDN metadata builder, state
slots and schedulers; accepting drafts (``num_accepted > 1``) is proven against the reference ops
in test_qwen38_gdn_spec.py, test_qwen38_ple_spec.py and test_qwen38_qsa_spec.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines import IN_PROCESS
from tests.qwen38_plugin.qwen38_reference import load_reference, reference_greedy_one
from tests.qwen38_plugin.test_qwen38_tp_engine import engine_result
from tests.qwen38_plugin.test_qwen38_vllm_engine import mixed_prompts

HERE = Path(__file__).resolve().parent
STEPS = 24


def run_engine(model: Path, num_spec: int, prompts: list[list[int]], **llm_kwargs: Any) -> dict[str, Any]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **IN_PROCESS}
    args = [str(model), "float32", str(STEPS), json.dumps(prompts), str(num_spec), json.dumps(llm_kwargs)]
    cmd = ["flock", "/tmp/qwen38-vllm.lock", sys.executable, str(HERE / "qwen38_engine_verify.py"), *args]
    return engine_result(subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False))


@pytest.fixture(scope="module")
def greedy(tiny_checkpoint: Callable[..., Path]) -> tuple[Path, list[list[int]], list[list[int]]]:
    model = tiny_checkpoint("qwen4_exp_text")
    # Each prompt of 3 or more tokens ends as it starts, so the n-gram proposer drafts at once.
    prompts = [p + p[:3] if len(p) >= 3 else p for p in mixed_prompts(2)]
    hf = load_reference(model, torch.float32)
    with torch.no_grad():
        expected = [reference_greedy_one(hf, prompt, STEPS)[0] for prompt in prompts]
    return model, prompts, expected


# 1 and 4 (the widest MTP setting); 2 and 3 take the same path (about 50 s an engine start on 2 cores)
@pytest.mark.parametrize("num_spec", [1, 4])
def test_ngram_speculation_keeps_greedy_output(
    greedy: tuple[Path, list[list[int]], list[list[int]]], num_spec: int
) -> None:
    model, prompts, expected = greedy
    result = run_engine(model, num_spec, prompts, max_num_batched_tokens=32, max_num_seqs=8)
    counters = result["spec_decode"]
    print(f"num_speculative_tokens={num_spec}: {counters}")
    assert counters["spec_decode_num_draft_tokens"] > 0, "no draft was verified"
    assert result["tokens"] == expected
