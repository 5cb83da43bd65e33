"""Tensor parallelism of the portable Qwen4Exp model.

In-process (no vLLM): the ranks of `Qwen4ExpCore` run in threads that sum their partial block
outputs through a real all-reduce over the threads; each rank loads the full checkpoint and keeps
its slice. Their greedy tokens must equal transformers' and the unsplit model's, with KV heads
split (2 KV heads over 2 ranks) and replicated (1 KV head on 2 ranks).

Through stock vLLM (`vllm.LLM`, CPU, fp32, `--tensor-parallel-size 2`): the same in
test_qwen38_tp_engine.py, which also proves that a geometry that cannot be split fails at startup.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from qwen38_plugin.model import (
    CheckpointError,
    ConfigError,
    Qwen4ExpCore,
    TensorParallel,
    greedy_generate,
    iter_safetensors,
)
from tests.qwen38_plugin.qwen38_reference import load_reference, rel_err
from tests.qwen38_plugin.test_qwen38_vllm_engine import mixed_prompts

STEPS = 32


class ThreadGroup:
    """All-reduce (sum) and all-gather (last dimension) between ranks that run in threads of this process."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=120)
        self.calls = 0

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t
        self.barrier.wait()
        parts = [s for s in self.slots if s is not None]
        if rank == 0:
            self.calls += 1
        self.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return parts

    def all_reduce(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            parts = self._exchange(rank, t)
            total = parts[0].clone()
            for part in parts[1:]:  # every rank sums in rank order: identical results
                total += part
            return total

        return reduce

    def all_gather(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: torch.cat(self._exchange(rank, t), dim=-1)


def load_rank(path: Path, tp: TensorParallel) -> Qwen4ExpCore:
    core = Qwen4ExpCore(AutoConfig.from_pretrained(path), tp)
    core.load_checkpoint_tensors(iter_safetensors(path))
    return core.eval()


def run_ranks(path: Path, size: int, prompts: list[list[int]]) -> tuple[list[Any], ThreadGroup, list[Qwen4ExpCore]]:
    group = ThreadGroup(size)
    ranks = [load_rank(path, TensorParallel(r, size, group.all_reduce(r), group.all_gather(r))) for r in range(size)]

    def generate(core: Qwen4ExpCore) -> Any:
        torch.set_num_threads(1)
        with torch.no_grad():
            return greedy_generate(core, prompts, STEPS)

    with ThreadPoolExecutor(size) as pool:
        results = list(pool.map(generate, ranks))
    return results, group, ranks


def reference_greedy(path: Path, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    hf = load_reference(path, torch.float32)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logits = hf(ids).logits[0, -1]
            generated = hf.generate(ids, max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append((generated[0, len(prompt) :].tolist(), logits))
    return out


@pytest.mark.parametrize(
    ("overrides", "kv_per_rank"),
    [({}, 1), ({"num_key_value_heads": 1}, 1)],
    ids=["kv-heads-split", "kv-head-replicated"],
)
def test_two_ranks_equal_transformers_and_one_rank(
    tiny_checkpoint: Callable[..., Path], overrides: dict[str, Any], kv_per_rank: int
) -> None:
    path = tiny_checkpoint("qwen4_exp_text", overrides=overrides, dtype="float32")
    config = AutoConfig.from_pretrained(path)
    prompts = mixed_prompts(3)
    (single,), _, _ = run_ranks(path, 1, prompts)
    results, group, ranks = run_ranks(path, 2, prompts)

    # Each rank holds half of the split tensors, and the KV heads its query heads read.
    qsa = ranks[1].model.layer(3).self_attn
    gdn = ranks[1].model.layer(0).linear_attn
    assert qsa.num_heads == config.num_attention_heads // 2 and qsa.num_kv_heads == kv_per_rank
    assert gdn.num_v_heads == config.linear_num_value_heads // 2
    assert ranks[1].model.layer(0).mlp.experts.down_proj.shape[-1] == config.moe_intermediate_size // 2
    assert ranks[1].lm_head.weight.shape[0] == ranks[1].model.embed_tokens.weight.shape[0] == config.vocab_size // 2
    table = ranks[1].model.layer(0).ple
    assert table is not None
    assert 2 * table.ple_embedding.ngram_embedding.weight.shape[0] % config.make_ngram_vocab_size_divisible_by == 0
    # per forward step: the embedding, each attention/GDN and MoE block, each PLE lookup, the logits
    assert group.calls >= STEPS * (2 + 2 * config.num_hidden_layers + len(config.ple_layer_ids))

    expected = reference_greedy(path, prompts)
    for tokens, first_logits in results:
        assert tokens == single[0]
        for i, (want_tokens, want_logits) in enumerate(expected):
            assert tokens[i] == want_tokens
            assert rel_err(first_logits[i], want_logits) < 1e-4
            assert rel_err(first_logits[i], single[1][i]) < 1e-5


def test_rank_refuses_unsplittable_geometry_and_wrong_full_shapes(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("qwen4_exp_text", dtype="float32")
    config = AutoConfig.from_pretrained(path)
    with pytest.raises(ConfigError, match="linear_num_key_heads: 2 heads cannot be split over tensor_parallel_size=4"):
        Qwen4ExpCore(config, TensorParallel(0, 4))
    core = Qwen4ExpCore(config, TensorParallel(1, 2))
    tensors = [
        (n, t[: t.shape[0] // 2] if n == "model.layers.3.self_attn.q_proj.weight" else t)
        for n, t in iter_safetensors(path)
    ]
    # A rank checks the checkpoint's full shape, not its own slice's.
    with pytest.raises(CheckpointError, match=r"model.layers.3.self_attn.q_proj.weight has shape \[256, 64\], the "
                       r"config implies \[512, 64\]"):  # fmt: skip
        core.load_checkpoint_tensors(tensors)
