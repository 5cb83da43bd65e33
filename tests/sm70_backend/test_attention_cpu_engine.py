"""`FLASH_ATTN_V100`'s portable path inside a stock vLLM engine on CPU.

A tiny fp16 Qwen3 served by `vllm.LLM` with ``attention_backend="FLASH_ATTN_V100"``
(attention_cpu_engine_run.py lets stock's CPU platform honour the choice): every attention layer
runs `FlashAttnV100Impl`, the paged cache is written and read through the backend's metadata and
the kernels' plain-torch references, with three requests together, a prompt prefilled in three
chunks, and decode. Prompt and greedy logprobs equal transformers' fp32 forward on the same ids
within fp16's tolerance (0.01, as the AWQ engine test), and the greedy tokens are its argmax.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import build_cached_checkpoint
from tests.engines import IN_PROCESS, run_engine_script
from tests.sm70_backend.test_awq_engine import TOL, worst_logprob_error

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = build_cached_checkpoint("qwen3", dtype="float16")
    out = tmp_path_factory.mktemp("v100_cpu") / "engine.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT), **IN_PROCESS}
    cmd = [
        sys.executable,
        str(Path(__file__).parent / "attention_cpu_engine_run.py"),
        str(model),
        str(out),
    ]
    result = run_engine_script(cmd, env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    data: dict[str, Any] = json.loads(out.read_text())
    data["model"] = model
    return data


def test_every_attention_layer_runs_flash_attn_v100(served: dict[str, Any]) -> None:
    impls = served["attention_impls"]
    assert impls and set(impls.values()) == {"FlashAttnV100Impl"}, impls


def test_logprobs_equal_transformers(served: dict[str, Any]) -> None:
    assert [len(r["prompt_ids"]) for r in served["requests"]] == [3, 17, 61]
    assert worst_logprob_error(served, served["model"], check_greedy=True) <= TOL
