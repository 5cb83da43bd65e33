"""Speculative decoding in QSA (`ops.qsa_paged` over the paged caches): verify rows of 1 + drafts
tokens whose rejected rows the next step rewrites, against `ops.qsa`'s ring form run over each
request's true sequence.

K/V, the compressed group keys and the raw-key ring are addressed by position, so a rejected
draft row leaves stale values behind at positions the next step writes again. What must hold:
- every kept token attends exactly as the oracle does over the true sequence (outputs and the
  tokens its indexer selects);
- a group closed by a rejected draft row gets its key recomputed when the true tokens close it
  again (the final key cache equals the oracle's group keys);
- a query sees only the groups complete at its own position, never a stale key written past it
  by rejected rows (the selections compare exactly);
- the smallest ring the model allocates for k speculative tokens (`qsa.ring_base_capacity`)
  holds the open group and every draft row (a smaller one breaks the group keys: checked too).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from qwen38_plugin.ops import qsa
from tests.qwen38_plugin.qsa_paged_harness import (
    Geometry,
    OracleRun,
    PagedRun,
    StepTokens,
    random_step,
    selection_mask,
)
from tests.qwen38_plugin.test_qwen38_qsa_paged import rel

RATIO = 4
FP32_TOL = 1e-5  # the same fp32 arithmetic in another summation order (test_qwen38_qsa_paged)


def _geometry(num_spec: int, ring_capacity: int | None = None) -> Geometry:
    capacity = qsa.ring_base_capacity(RATIO, num_spec) if ring_capacity is None else ring_capacity
    return Geometry(
        heads=4, kv_heads=2, dim=16, index_heads=4, index_dim=16, ratio=RATIO, topk=2, block_size=16,
        ring_capacity=capacity, rotary_dim=8, max_len=96,
    )  # fmt: skip


@dataclass
class Seq:
    true: StepTokens  # the true sequence's per-token tensors
    prompt: int
    done: int = 0
    out: dict[int, torch.Tensor] = field(default_factory=dict)
    selected: dict[int, torch.Tensor] = field(default_factory=dict)


_FIELDS = ("q", "gate", "k", "v", "index_q", "raw_keys")


def _assemble(geo: Geometry, rows: list[tuple[int, Seq, int, list[bool]]], gen: torch.Generator) -> StepTokens:
    """The step's tokens: each row's true tokens from ``done`` on, a wrong draft (random rows)
    wherever its ``kept`` flag is False."""
    pieces: dict[str, list[torch.Tensor]] = {name: [] for name in _FIELDS}
    for _, s, n, kept in rows:
        wrong = random_step(geo, [0], [n], [0], s.true.q.dtype, gen)
        keep = torch.tensor(kept)
        for name in _FIELDS:
            true = getattr(s.true, name)[s.done : s.done + n]
            other = getattr(wrong, name)
            pieces[name].append(torch.where(keep.view(-1, *[1] * (true.dim() - 1)), true, other))
    cat = {name: torch.cat(parts) for name, parts in pieces.items()}
    return StepTokens([r for r, _, _, _ in rows], [n for _, _, n, _ in rows], [s.done for _, s, _, _ in rows], **cat)


def _simulate(geo: Geometry, num_spec: int, seed: int) -> dict[str, int]:
    """Prefill, then verify steps with random drafts; returns counts of the events that matter."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32
    prompts = [3, 9, 14]
    k_norm_weight = (torch.randn(geo.index_dim, generator=gen) * 0.2).to(dtype)
    paged = PagedRun(geo, len(prompts), dtype, "cpu", gen, k_norm_weight)
    seqs = [Seq(random_step(geo, [r], [p + 48], [0], dtype, gen), p) for r, p in enumerate(prompts)]
    events = {"rejected_rows": 0, "groups_closed_by_rejected_rows": 0, "queries_behind_a_stale_group": 0}
    stale_group_end = [-1] * len(seqs)  # the last position of a group a rejected row closed
    for step in range(60):
        rows: list[tuple[int, Seq, int, list[bool]]] = []
        for r, s in enumerate(seqs):
            if step == 0:
                rows.append((r, s, s.prompt, [True] * s.prompt))
            elif s.done + num_spec + 1 <= s.true.q.shape[0]:
                drafts = rng.randint(0, num_spec)
                correct = rng.randint(0, drafts)
                rows.append((r, s, 1 + drafts, [True] * (1 + correct) + [False] * (drafts - correct)))
        if not rows:
            break
        rng.shuffle(rows)
        out, selected = paged.step(_assemble(geo, rows, gen), padding=rng.randint(0, 2))
        first = 0
        for r, s, n, kept in rows:
            accepted = [*kept, False].index(False)
            for j in range(n):
                position = s.done + j
                if j < accepted:
                    s.out[position], s.selected[position] = out[first + j], selected[first + j]
                    if position < stale_group_end[r]:
                        events["queries_behind_a_stale_group"] += 1
                else:
                    events["rejected_rows"] += 1
                    if (position + 1) % geo.ratio == 0:
                        events["groups_closed_by_rejected_rows"] += 1
                        stale_group_end[r] = position
            s.done += accepted
            first += n

    oracle = OracleRun(geo, len(seqs), k_norm_weight)
    for r, s in enumerate(seqs):
        assert s.done > s.prompt + 20, "the simulation verified too few tokens"
        names = {name: getattr(s.true, name)[: s.done] for name in _FIELDS}
        (expected,), (mask,) = oracle.step(StepTokens([r], [s.done], [0], **names))
        got = torch.stack([s.out[p] for p in range(s.done)])
        assert rel(got, expected) < FP32_TOL, f"request {r}: outputs differ from the oracle's"
        for p in range(s.done):
            row = selection_mask(s.selected[p][None], torch.tensor([p]), geo.ratio, s.done)[0]
            assert torch.equal(row, mask[p]), f"request {r} position {p}: selection differs from the oracle's"
        # Every group of the kept sequence: its key as the oracle computes it (recomputed where a
        # rejected row had closed it).
        indexer = oracle.indexer[r]
        assert indexer is not None
        groups = torch.arange(s.done // geo.ratio)
        per_block = geo.block_size // geo.ratio
        keys = paged.key_cache[paged.key_table[r, groups // per_block], 0, groups % per_block]
        assert rel(keys, indexer.block_keys) < FP32_TOL, f"request {r}: group keys differ from the oracle's"
    return events


@pytest.mark.parametrize("num_spec", [1, 2, 4])
def test_verify_steps_match_the_oracle_over_the_true_sequences(num_spec: int) -> None:
    events = _simulate(_geometry(num_spec), num_spec, seed=num_spec)
    # the cases this test is about did happen
    assert events["rejected_rows"] > 20
    assert events["groups_closed_by_rejected_rows"] > 3
    if num_spec > 1:  # with one draft the next step starts at the stale group's last position
        assert events["queries_behind_a_stale_group"] > 0


def test_a_ring_without_room_for_the_drafts_breaks_group_keys() -> None:
    # The ring holds the open group plus the k draft rows; one group less (here 4 rows for
    # ratio 4 and 4 speculative tokens) lets draft rows overwrite members of the open group.
    assert qsa.ring_base_capacity(RATIO, 4) == 8
    with pytest.raises(AssertionError, match=r"differ from the oracle|selection differs"):
        _simulate(_geometry(4, ring_capacity=4), 4, seed=4)
