"""bench_mtp_trained.py trains the target with transformers' QSA indexer batched
(benchmarks/qwen38_plugin/batched_qsa_indexer.py): the same selected-token masks as transformers'
own per-query loop (up to the choice among blocks of equal score, which top-k leaves open in both),
so the same logits and gradients, on the tiny Qwen4Exp (indexer budget 16 in blocks of 4, so from
query 19 on the indexer leaves blocks out); other masks are refused."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "qwen38_plugin"))

from batched_qsa_indexer import UnsupportedMask, batched_qsa_indexer, batched_selection, block_scores

LENGTH = 70  # 17 complete blocks of 4 against a budget of 4 blocks


@pytest.fixture(scope="module")
def net(tiny_checkpoint: Callable[..., Path]) -> Any:
    from transformers import Qwen4ExpForCausalLM

    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM.from_pretrained(str(tiny_checkpoint("qwen4_exp_text")), dtype=torch.float32)
    return model.eval()


def indexer_calls(net: Any, ids: torch.Tensor) -> list[tuple[Any, tuple[Any, ...]]]:
    """Each QSA indexer's module and positional inputs during one forward pass."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    calls: list[tuple[Any, tuple[Any, ...]]] = []
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: calls.append((mod, args)))
        for m in net.modules()
        if isinstance(m, Qwen4ExpTextQSAIndexer)
    ]
    try:
        with torch.no_grad():
            net(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def test_masks_equal_transformers_loop_up_to_ties(net: Any) -> None:
    ids = torch.randint(0, net.config.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    calls = indexer_calls(net, ids)
    assert calls, "the tiny Qwen4Exp has no QSA layer"
    causal = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    for module, args in calls:
        with torch.no_grad():
            looped = module(*args)
            batched = batched_selection(module, *args)
            scores = block_scores(module, args[0], args[1])
        assert batched.dtype == looped.dtype and batched.shape == looped.shape
        ratio = module.compress_ratio
        for b in range(2):
            # the indexer did leave tokens out (else this would compare plain causal attention)
            assert (causal & ~batched[b, 0]).any()
            for q in range(LENGTH):
                if torch.equal(batched[b, 0, q], looped[b, 0, q]):
                    continue
                # a difference is a choice among blocks of equal score: the same scores are kept
                complete = (q + 1) // ratio
                starts = torch.arange(complete) * ratio
                kept = [scores[b, q, :complete][m[b, 0, q, starts]].sort().values for m in (batched, looped)]
                torch.testing.assert_close(kept[0], kept[1], rtol=1e-5, atol=1e-6)
                # and the tokens after the last complete block (the open group) are in both
                assert torch.equal(batched[b, 0, q, complete * ratio :], looped[b, 0, q, complete * ratio :])


def test_training_step_equals_transformers_loop(net: Any) -> None:
    """Gradients through the patched module equal the loop's where no top-k choice is left to ties
    (19 tokens: 4 complete blocks, all within the budget of 4)."""
    ids = torch.randint(0, net.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(2))

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        net.zero_grad(set_to_none=True)
        loss = net(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in net.parameters() if p.grad is not None]

    loss, grads = loss_and_grads()
    with batched_qsa_indexer():
        batched_loss, batched_grads = loss_and_grads()
    net.zero_grad(set_to_none=True)
    assert torch.equal(batched_loss, loss)
    assert len(batched_grads) == len(grads)
    for a, b in zip(batched_grads, grads, strict=True):
        assert torch.equal(a, b)


def test_padded_mask_is_refused(net: Any) -> None:
    ids = torch.randint(0, net.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    padding = torch.ones_like(ids)
    padding[1, :5] = 0
    with batched_qsa_indexer(), pytest.raises(UnsupportedMask, match="attention_mask"), torch.no_grad():
        net(input_ids=ids, attention_mask=padding, use_cache=False)
