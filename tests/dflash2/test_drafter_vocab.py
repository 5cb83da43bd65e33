"""`dflash2.drafter_reference`'s reduced draft vocabulary (``draft_vocab_size``, own lm_head, ``d2t``)
in plain torch: where its logits land in the target's vocabulary, what a checkpoint of it holds, and
the errors for bad input. That vLLM serves it the same way: test_drafter_reference.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dflash2.drafter_reference import DFlashDrafterReference, DrafterReferenceError
from dflash2.tiny import drafter_config

VOCAB, HIDDEN = 1000, 64
TARGET = {"hidden_size": HIDDEN, "num_hidden_layers": 4, "vocab_size": VOCAB, "pad_token_id": 999}


def config(**extra: Any) -> dict[str, Any]:
    return {**drafter_config(TARGET, target_layer_ids=[0, 3]), **extra}


def test_logits_scatter_the_own_rows_to_their_target_ids_and_mask_the_rest() -> None:
    drafter = DFlashDrafterReference(config(draft_vocab_size=5))
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    target_head = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1))
    ids = [700, 3, 512, 998, 41]  # not sorted: row i is token ids[i]
    drafter.set_draft_vocabulary(ids, target_head)
    assert drafter.draft_token_ids().tolist() == ids
    assert torch.equal(drafter.lm_head.weight, target_head[ids])
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(2))
    logits = drafter.logits(hidden, target_head)
    assert logits.shape == (3, VOCAB)
    torch.testing.assert_close(logits[:, ids], hidden @ target_head[ids].t())
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[ids] = False
    assert bool(torch.isneginf(logits[:, others]).all())
    # the checkpoint holds the own head and stock's offsets (d2t[i] = ids[i] - i, int64)
    state = drafter.state_dict()
    assert state["d2t"].dtype == torch.int64
    assert state["d2t"].tolist() == [t - i for i, t in enumerate(ids)]
    assert state["lm_head.weight"].shape == (5, HIDDEN)


def test_the_full_vocabulary_uses_the_target_head_and_holds_no_head() -> None:
    drafter = DFlashDrafterReference(config())
    target_head = torch.randn(VOCAB, HIDDEN)
    hidden = torch.randn(2, HIDDEN)
    torch.testing.assert_close(drafter.logits(hidden, target_head), hidden @ target_head.t())
    assert not {"lm_head.weight", "d2t"} & set(drafter.state_dict())
    with pytest.raises(DrafterReferenceError, match="full vocabulary"):
        drafter.set_draft_vocabulary(list(range(VOCAB)), target_head)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, 2, 3], "need 4 distinct token ids, got 3"),
        ([1, 2, 3, 3], r"got 4 \(3 distinct\)"),
        ([1, 2, 3, VOCAB], f"0..{VOCAB - 1}"),
        ([-1, 2, 3, 4], f"0..{VOCAB - 1}"),
    ],
)
def test_a_bad_draft_vocabulary_is_refused(ids: list[int], message: str) -> None:
    drafter = DFlashDrafterReference(config(draft_vocab_size=4))
    with pytest.raises(DrafterReferenceError, match=message):
        drafter.set_draft_vocabulary(ids, torch.zeros(VOCAB, HIDDEN))


@pytest.mark.parametrize("size", [0, VOCAB + 1])
def test_a_draft_vocab_size_outside_the_vocabulary_names_the_field(size: int) -> None:
    with pytest.raises(DrafterReferenceError, match="draft_vocab_size"):
        DFlashDrafterReference(config(draft_vocab_size=size))
