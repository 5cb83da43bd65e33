"""MTP speculative decoding on the portable model in a real vLLM engine on CPU: the checkpoint's MTP
head drafts (`qwen38_plugin.vllm_mtp`, chosen by the dispatcher for ``Qwen4ExpMTP``), the target
verifies, and greedy output equals the output without speculation and transformers' greedy
output, for five concurrent requests of 1-73 tokens whose chunked prefills (32 tokens a step)
share steps with verify rows.

- The tiny random checkpoint with a random MTP head (``num_speculative_tokens`` 4) at
  ``--tensor-parallel-size 2``: its drafts are almost never right, so this proves the draft path
  (the proposer's buffers, the draft layer's caches in vLLM's K/V group, the hidden-state buffer
  ``hc * H`` wide) and rejection, with the target and the head split over two ranks.
- The same checkpoint with an lm_head of two tokens (row X = w, row Y = -w, the other rows 0:
  every argmax is X or Y, decided by the sign of the final hidden state's projection on w, which
  depends on every layer and state): the head's drafts are accepted about half the time, so
  verify steps keep 2-5 tokens and the GDN / PLE / QSA states roll from the slot of the last
  accepted token. The same greedy output as transformers and as the engine without speculation.

The engine script (`qwen38_engine_verify.py`) turns prefix caching off, which the dispatcher
requires with speculation on CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines import IN_PROCESS, run_engine_script
from tests.qwen38_plugin.qwen38_reference import load_reference, reference_greedy_one
from tests.qwen38_plugin.test_qwen38_tp_engine import engine_result
from tests.qwen38_plugin.test_qwen38_vllm_engine import mixed_prompts

HERE = Path(__file__).resolve().parent
STEPS = 24
MTP = {"mtp_num_hidden_layers": 1}
TWO_TOKENS = (1_000, 2_000)


def run_engine(model: Path, num_spec: int, prompts: list[list[int]], tp: int = 1, **llm_kwargs: Any) -> dict[str, Any]:
    """The engine script's result; ``tp`` ranks (``tensor_parallel_size``), a core each."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **IN_PROCESS}
    kwargs = {**llm_kwargs, **({"tensor_parallel_size": tp} if tp > 1 else {})}
    args = [str(model), "float32", str(STEPS), json.dumps(prompts), str(num_spec), json.dumps(kwargs)]
    cmd = [sys.executable, str(HERE / "qwen38_engine_verify.py"), *args]
    return engine_result(run_engine_script(cmd, env, cores=tp))


def two_token_checkpoint(source: Path, target: Path, scale: float = 1.0) -> Path:
    """``source`` with lm_head rows X = w, Y = -w and every other row 0 (``w`` a seeded normal
    vector times ``scale``: the argmax does not depend on it, the X-vs-Y probabilities do)."""
    from safetensors.torch import load_file, save_file

    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    (weights,) = target.glob("*.safetensors")
    tensors = load_file(weights)
    head = tensors["lm_head.weight"]
    w = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float32) * scale
    head.zero_()
    head[TWO_TOKENS[0]], head[TWO_TOKENS[1]] = w.to(head.dtype), (-w).to(head.dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    return target


def greedy_reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = load_reference(model, torch.float32)
    with torch.no_grad():
        return [reference_greedy_one(hf, prompt, STEPS)[0] for prompt in prompts]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts(2)


@pytest.fixture(scope="module")
def random_head(tiny_checkpoint: Callable[..., Path], prompts: list[list[int]]) -> tuple[Path, list[list[int]]]:
    model = tiny_checkpoint("qwen4_exp_text", overrides=MTP, dtype="float32")
    return model, greedy_reference(model, prompts)


# 4, the widest; 1-3 take the same path (about 40 s an engine start on 2 cores); the MTP server test
# runs 3, and its concurrency ladder verifies widths 3, 2 and 1. At --tensor-parallel-size 2: the
# target and the MTP head's layers split over two ranks (the accepted-drafts test below and the MTP
# server run one rank).
@pytest.mark.parametrize("num_spec", [4])
def test_mtp_speculation_keeps_greedy_output_at_tp2(
    random_head: tuple[Path, list[list[int]]], prompts: list[list[int]], num_spec: int
) -> None:
    model, expected = random_head
    result = run_engine(model, num_spec, prompts, tp=2, max_num_batched_tokens=32, max_num_seqs=8)
    counters = result["spec_decode"]
    print(f"random MTP head, num_speculative_tokens={num_spec}, TP=2: {counters}")
    assert counters["spec_decode_num_drafts"] > 0 and counters["spec_decode_num_draft_tokens"] > 0
    assert result["tokens"] == expected


def test_accepted_mtp_drafts_roll_states_correctly(
    random_head: tuple[Path, list[list[int]]], prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = two_token_checkpoint(random_head[0], tmp_path_factory.mktemp("two-token") / "model")
    expected = greedy_reference(model, prompts)
    assert {t for row in expected for t in row} == set(TWO_TOKENS)  # both tokens occur: the sign varies
    plain = run_engine(model, 0, prompts, max_num_batched_tokens=32, max_num_seqs=8)
    assert plain["tokens"] == expected
    result = run_engine(model, 4, prompts, max_num_batched_tokens=32, max_num_seqs=8)
    counters = result["spec_decode"]
    rate = counters["spec_decode_num_accepted_tokens"] / counters["spec_decode_num_draft_tokens"]
    print(f"two-token lm_head, num_speculative_tokens=4: {counters}, acceptance {rate:.2f}")
    # accepted drafts (several per verify step) happened, and the output still follows transformers
    assert counters["spec_decode_num_accepted_tokens"] >= 20 and rate > 0.2
    assert result["tokens"] == expected
