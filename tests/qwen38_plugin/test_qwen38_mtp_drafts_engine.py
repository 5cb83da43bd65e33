"""Stock vLLM's MTP proposer drafts with the portable head exactly what the oracle head drafts.

One stock vLLM engine on CPU (about 45 s on 2 cores): the tiny Qwen4Exp with a random MTP head, fp32,
3 drafts, three greedy requests of 5 / 23 / 41 random tokens together (the engine side of
tests/dflash2/test_drafter_reference.py with ``DRAFTER_CHECK_METHOD=mtp``: every step's drafts taken
from the scheduler as it schedules them, with the request's length then). For each step the oracle
(`qwen38_plugin.mtp_reference`) reads the request's tokens so far and the plain-torch target's streams,
runs its first pass, then chains its drafts on its own output streams and K/V: every draft, at every
draft position, must be the oracle's.

test_qwen38_mtp_drafter.py holds the head module to the oracle on hand-made metadata; this holds the
proposer's use of it (which streams, positions, slots and K/V the chained steps get) in a real engine.
The same comparison runs on a GPU, in vLLM's V2 runner, as benchmarks/qwen38_plugin/drafts_check.py --method mtp.
It can fail: chained steps that read the target's streams instead of their own lose the later drafts
(checked below).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dflash2.test_drafter_reference import DRAFTS, MAX_TOKENS, PROMPT_LENGTHS, engine_command, engine_result
from tests.engines import run_engine_script
from tests.qwen38_plugin.test_qwen38_mtp_reference import MTP, load_oracle
from tests.qwen38_plugin.test_qwen38_vllm_engine import reference_greedy

ROOT = Path(__file__).resolve().parents[2]


def mtp_reference_drafts(
    target: Path, result: dict[str, Any], *, chain_own_streams: bool = True
) -> tuple[list[list[int]], list[list[float]]]:
    """The oracle head's drafts at each recorded step (as ``Qwen4ExpMTPReference.draft``) and each
    draft's top-two logit margin; ``chain_own_streams=False`` is a deliberate mistake (the chained
    steps read the target's last streams)."""
    from qwen38_plugin.model import DictStateStore, SequenceCache
    from qwen38_plugin.mtp_reference import MTPCache

    core, head = load_oracle(target)
    drafts, margins = [], []
    with torch.no_grad():
        streams = []  # each request's target streams over all its tokens (causal: a prefix's are the same)
        for tokens in result["tokens"]:
            ids = torch.tensor(tokens)
            store = DictStateStore(core, [SequenceCache()])
            streams.append(core.forward_streams(ids, torch.arange(len(tokens)), [len(tokens)], store)[1])
        for step in result["drafts"]:
            length, k = step["length"], len(step["drafts"])
            ids = torch.tensor(result["tokens"][step["request"]][:length])
            target = streams[step["request"]][: length - 1]
            if chain_own_streams:
                tokens, logits, _ = head.draft(core, target, ids, k)
            else:
                cache = MTPCache()
                _, first = head.step(core, target, ids[1:], torch.arange(length - 1), cache)
                tokens, rows = [int(first[-1].argmax())], [first[-1:]]
                for j in range(1, k):
                    _, row = head.step(
                        core, target[-1:], torch.tensor(tokens[-1:]), torch.tensor([length - 2 + j]), cache
                    )
                    tokens.append(int(row.argmax()))
                    rows.append(row)
                logits = torch.cat(rows)
            top = logits.topk(2, dim=-1).values
            drafts.append(tokens)
            margins.append((top[:, 0] - top[:, 1]).tolist())
    return drafts, margins


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Callable[..., Path]) -> tuple[Path, dict[str, Any]]:
    target = tiny_checkpoint("qwen4_exp_text", overrides=MTP, dtype="float32")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT), "DRAFTER_CHECK_METHOD": "mtp"}
    proc = run_engine_script(engine_command(target, Path("unused")), env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return target, engine_result(proc.stdout)


def assert_drafts_are_the_oracles(target: Path, result: dict[str, Any]) -> None:
    steps = result["drafts"]
    assert len({s["request"] for s in steps}) == len(PROMPT_LENGTHS)
    assert all(len(s["drafts"]) == DRAFTS for s in steps) and len(steps) >= 20, steps
    drafts, margins = mtp_reference_drafts(target, result)
    mismatches = [
        (i, j, margins[i][j])
        for i, (step, ref) in enumerate(zip(steps, drafts, strict=True))
        for j in range(DRAFTS)
        if step["drafts"][j] != ref[j]
    ]
    # equal, but where the oracle's top two logits tie within fp32 noise (random weights, 248k tokens)
    assert all(m < 1e-4 for _, _, m in mismatches) and len(mismatches) <= 2, mismatches
    assert sum(m > 1e-3 for row in margins for m in row) >= 0.9 * DRAFTS * len(steps)  # clear argmaxes


def test_every_draft_position_is_the_oracles(served: tuple[Path, dict[str, Any]]) -> None:
    assert_drafts_are_the_oracles(*served)


@pytest.fixture(scope="module")
def served_dcp(tiny_checkpoint: Callable[..., Path]) -> tuple[Path, dict[str, Any], str]:
    """The same engine at TP=2 with decode context parallelism 2 on a checkpoint with one KV head (both
    ranks replicate it and hold every other position of its K/V): the reference deployment's shape
    (TP4 / DCP2 over Flash-Next's two KV heads) with its default speculation, MTP."""
    target = tiny_checkpoint("qwen4_exp_text", overrides={**MTP, "num_key_value_heads": 1}, dtype="float32")
    more = {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT), "DRAFTER_CHECK_METHOD": "mtp",
           "DRAFTER_CHECK_ENGINE_ARGS": json.dumps(more)}  # fmt: skip
    proc = run_engine_script(engine_command(target, Path("unused")), env, cores=2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return target, engine_result(proc.stdout), proc.stdout + proc.stderr


def test_mtp_beside_decode_context_parallelism_drafts_the_oracles_tokens(
    served_dcp: tuple[Path, dict[str, Any], str],
) -> None:
    target, result, log = served_dcp
    # both ranks split the target's and the draft steps' K/V positions (stock's CPU kernels would refuse)
    installed = "decode context parallelism on CPU: the K/V slot mapping splits positions over ranks"
    assert log.count(installed) == 2, log[-3000:]
    # lossless: the served tokens are the target's own greedy tokens
    prompts = [tokens[:length] for tokens, length in zip(result["tokens"], PROMPT_LENGTHS, strict=True)]
    greedy = reference_greedy(target, prompts, torch.float32, steps=MAX_TOKENS)
    assert result["tokens"] == [p + g for p, g in zip(prompts, greedy, strict=True)]
    # and each draft is the oracle head's: the chained steps' K/V and indexer keys are where they belong
    assert_drafts_are_the_oracles(target, result)


def test_chaining_on_the_target_streams_loses_the_later_drafts(served: tuple[Path, dict[str, Any]]) -> None:
    target, result = served
    drafts, _ = mtp_reference_drafts(target, result, chain_own_streams=False)
    steps = result["drafts"]
    first = sum(s["drafts"][0] == d[0] for s, d in zip(steps, drafts, strict=True))
    later = sum(s["drafts"][j] == d[j] for s, d in zip(steps, drafts, strict=True) for j in range(1, DRAFTS))
    assert first == len(steps)  # the first pass is the same computation
    assert later < 0.5 * (DRAFTS - 1) * len(steps), later
