"""DFlash through a real stock vLLM engine on CPU at tensor parallelism 2: the ladder's verify
widths, the column-parallel `fc`, the target's greedy tokens.

One engine start (about a minute on 2 cores): a tiny Qwen3 target in fp32 at
``--tensor-parallel-size 2``, a tiny random DFlash drafter (`dflash2.tiny`) whose `fc` dflash2
makes column-parallel (K17), ``--speculative-config`` with the seed's ladder ``{"4": 3, "5": 4}``
and 7 drafts, six concurrent greedy requests of different lengths. `spec_engine_run.py` records
every step's `SchedulerOutput`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dflash2.ladder import parse_ladder
from dflash2.tiny import build_tiny_drafter
from tests.engines import run_engine_script

HERE = Path(__file__).resolve().parent
K = 7
LADDER = {"4": 3, "5": 4}
MAX_TOKENS = [4, 8, 12, 16, 20, 28]


def reference_greedy(model: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """transformers' greedy tokens of the target alone (no speculation)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, steps in zip(prompts, max_tokens, strict=True):
            ids = torch.tensor([prompt])
            generated = hf.generate(ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(generated[0, len(prompt) :].tolist())
    return out


def run_engine(model: Path, spec: dict[str, object], prompts: list[list[int]], max_tokens: list[int]) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    extra = {
        "max_num_seqs": 8,
        "enforce_eager": True,
        "dtype": "float32",
        "gpu_memory_utilization": 0.05,
        "tensor_parallel_size": 2,
    }
    args = [str(model), json.dumps(spec), json.dumps(prompts), json.dumps(max_tokens), json.dumps(extra)]
    cmd = [sys.executable, str(HERE / "spec_engine_run.py"), *args]
    proc = run_engine_script(cmd, env, cores=2)  # TP=2: one core per rank
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "dflash_concurrency_drafts {'4': 3, '5': 4} -> num_speculative_tokens_per_batch_size" in log, log[-6000:]
    # both ranks built the drafter's fc column-parallel (each holds half of its rows)
    for rank in (0, 1):
        line = rf"\(Worker_TP{rank} pid=\d+\).*dflash2: DFlash fc \[256 -> 128\] column-parallel over 2 ranks"
        assert re.search(line, log), log[-6000:]
    result: dict = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"tokens"')][-1])
    return result


@pytest.fixture(scope="module")
def ladder_run(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple:
    target = tiny_checkpoint("qwen3", dtype="float32")
    drafter = build_tiny_drafter(tmp_path_factory.mktemp("drafter") / "dflash", target)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 248_000, (n,), generator=gen).tolist() for n in (5, 9, 3, 12, 7, 10)]
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": K, "dflash_concurrency_drafts": LADDER}
    return target, prompts, run_engine(target, spec, prompts, MAX_TOKENS)


def test_each_step_verifies_the_ladders_width(ladder_run: tuple) -> None:
    _, _, result = ladder_run
    ladder = parse_ladder(LADDER, K)
    steps = result["steps"]
    assert steps[0]["scheduled"] == len(MAX_TOKENS)  # all six prefilled in the first step
    widths_seen = set()
    for s, step in enumerate(steps):
        verified = [w for w in step["verified"] if w is not None]
        assert len(verified) == step["scheduled"]  # every unfinished request runs in every step
        # what the drafter is asked for in this step, for the next: the ladder at this step's count
        assert step["next_drafts"] == ladder.width(step["scheduled"]), (s, step)
        if s == 0:
            assert verified == [0] * len(verified)  # prefill: nothing to verify yet
            continue
        # Stock vLLM fixes the width when it drafts, one step before it verifies, so the count
        # that decides is the previous step's ...
        before = steps[s - 1]["scheduled"]
        assert verified == [ladder.width(before)] * len(verified), (s, step, before)
        # ... which is the seed's rule (the count of the verifying step) wherever the count held.
        if before == step["scheduled"]:
            assert verified == [ladder.width(step["scheduled"])] * len(verified)
        widths_seen.update(verified)
    assert widths_seen == {7, 3, 4}, widths_seen  # every rung ran: 1-3 -> 7, 4 -> 3, 5-6 -> 4
    # vLLM's own per-request metrics report the same verified drafts, step by step.
    per_request = [[step["verified"][i] for step in steps[1:] if i < len(step["verified"])] for i in range(6)]
    assert sorted(result["drafted"]) == sorted([[w for w in row if w is not None] for row in per_request])
    for tokens, took in zip(result["tokens"], result["accepted"], strict=True):
        assert 1 + sum(a + 1 for a in took) == len(tokens)  # each step: its accepted drafts + one token


def test_tokens_equal_the_target_alone(ladder_run: tuple) -> None:
    target, prompts, result = ladder_run
    assert result["tokens"] == reference_greedy(target, prompts, MAX_TOKENS)
