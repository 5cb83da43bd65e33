"""Stock vLLM (CPU, fp32) serving the portable Qwen4Exp model with `--tensor-parallel-size 2`, and
preempting its requests.

One engine start at TP=2 with a KV-cache budget so small (`num_gpu_blocks_override`) that the
requests submitted together do not fit: vLLM must preempt running requests (recompute: a preempted
request later starts over from its prompt and the tokens it already produced) and count it in
`vllm:num_preemptions`. Before that, the same engine decodes every prompt by itself (no
preemption) - the unpreempted run. Prompts: mixed short ones and long ones whose 32 decode steps
cross a KV block boundary; a step budget of 64 tokens chunks the prefills. Its tokens must equal
transformers', which TP=1 equals in fp32 on the server of test_qwen38_vllm_server.py (and under
preemption in tests/soak), so TP=2 gives TP=1's tokens without a TP=1 engine here.

A second start, at TP=2 on a checkpoint with a single KV head, replicates that head on both ranks
(as Flash-Next's 2 KV heads are replicated at TP=4); a third splits that head's positions over the
ranks (decode-context parallelism); a fourth, at TP=2 on a checkpoint whose GDN key heads cannot be
split over 2 ranks, must fail while vLLM builds its config and name the head count.
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

from tests.engines import IN_PROCESS, run_engine_script
from tests.qwen38_plugin.test_qwen38_vllm_engine import STEPS, mixed_prompts, reference_greedy

HERE = Path(__file__).resolve().parent
# Room for a few of the requests at once (each takes one block per GDN layer and per QSA cache
# for every started KV block); the long prompts then need new blocks while decoding.
ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 16,
    "num_gpu_blocks_override": 33,
    "enable_prefix_caching": False,  # a preempted request recomputes everything
    "disable_log_stats": False,  # vllm:num_preemptions
}


def start_engine(model: Path, tp: int, prompts: list[list[int]], **overrides: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **IN_PROCESS}
    extra = {**ENGINE_ARGS, "tensor_parallel_size": tp, "solo": True, **overrides}
    args = [str(model), "float32", str(STEPS), json.dumps(prompts), json.dumps(extra)]
    cmd = [sys.executable, str(HERE / "qwen38_engine_greedy.py"), *args]
    return run_engine_script(cmd, env, cores=tp)  # one core per rank


def engine_result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"tokens"')]
    assert lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen4_exp_text", dtype="float32")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    # 230-250 tokens: 32 more tokens cross a KV block boundary for any block size from 32 to 256
    long = [torch.randint(0, 248_000, (n,), generator=gen).tolist() for n in (236, 244, 231, 249)]
    return mixed_prompts(0) + long


@pytest.fixture(scope="module")
def tp2_run(checkpoint: Path, prompts: list[list[int]]) -> dict[str, Any]:
    return engine_result(start_engine(checkpoint, 2, prompts))


@pytest.fixture(scope="module")
def reference(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    return reference_greedy(checkpoint, prompts, torch.float32)


def test_tp2_greedy_tokens_equal_transformers(tp2_run: dict[str, Any], reference: list[list[int]]) -> None:
    assert tp2_run["tokens"] == reference
    assert tp2_run["solo"] == reference


def test_preempted_requests_produce_the_unpreempted_tokens(tp2_run: dict[str, Any], reference: list[list[int]]) -> None:
    assert tp2_run["preemptions"]["solo"] == 0, "one request at a time must fit in the KV budget"
    assert tp2_run["preemptions"]["together"] > 0, "the KV budget no longer forces a preemption; lower it"
    assert tp2_run["tokens"] == tp2_run["solo"]
    assert tp2_run["tokens"] == reference


def test_tp2_with_a_replicated_kv_head_equals_transformers(
    tiny_checkpoint: Callable[..., Path], prompts: list[list[int]]
) -> None:
    # One KV head, two ranks: each rank keeps the whole K/V projection and its own copy of the KV
    # cache for its half of the query heads.
    model = tiny_checkpoint("qwen4_exp_text", overrides={"num_key_value_heads": 1}, dtype="float32")
    run = engine_result(start_engine(model, 2, prompts, num_gpu_blocks_override=None, solo=False))
    assert run["tokens"] == reference_greedy(model, prompts, torch.float32)


def test_decode_context_parallel_2_at_tp2_equals_transformers(
    tiny_checkpoint: Callable[..., Path], prompts: list[list[int]]
) -> None:
    # The replicated KV head of the test above, its positions split over the two ranks
    # (`--decode-context-parallel-size 2`, as the reference deployment's TP4 / DCP2 splits Flash-Next's
    # two KV heads): each rank writes and reads half of every request's K/V, in runs of 2 positions.
    # Every prompt alone first, then all together from the prefix cache the first pass filled.
    model = tiny_checkpoint("qwen4_exp_text", overrides={"num_key_value_heads": 1}, dtype="float32")
    proc = start_engine(
        model, 2, prompts, num_gpu_blocks_override=None, solo=True, decode_context_parallel_size=2,
        cp_kv_cache_interleave_size=2, enable_prefix_caching=True,
    )  # fmt: skip
    run = engine_result(proc)
    reference = reference_greedy(model, prompts, torch.float32)
    assert run["solo"] == reference
    assert run["tokens"] == reference
    assert run["prefix_cache_hits"] > 0
    # both ranks split the positions (stock's CPU slot mapping would have refused)
    log = proc.stdout + proc.stderr
    installed = "decode context parallelism on CPU: the K/V slot mapping splits positions over ranks"
    assert log.count(installed) == 2, log[-3000:]


def test_geometry_that_cannot_split_fails_at_startup_naming_the_head_count(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    # One GDN key head (three value heads) cannot be split over two ranks; stock vLLM's own
    # check (query heads) passes, ours must refuse.
    model = tiny_checkpoint(
        "qwen4_exp_text", overrides={"linear_num_key_heads": 1, "linear_num_value_heads": 3}, dtype="float32"
    )
    proc = start_engine(model, 2, [[1, 2, 3]])
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "linear_num_key_heads: 1 heads cannot be split over tensor_parallel_size=2" in log
    # while vLLM built its config (the config hook), before any worker started
    assert "validation error for VllmConfig" in log and "world_size=2" not in log, log[-3000:]
