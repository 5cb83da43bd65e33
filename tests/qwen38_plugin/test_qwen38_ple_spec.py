"""Speculative decoding in PLE (`ops.ple_varlen` with ``write_indices``, split by
`vllm_ple.step_parts` from vLLM's `GDNAttentionMetadata`): the n-gram context and the conv state
take the GDN slot's per-draft-position slots, against the reference `ops.ple.ple` run over each
request's true sequence.

A simulated engine as in test_qwen38_gdn_spec.py: requests prefill, then verify drafts step after
step (a draft is the true next token with its true stream row, or a wrong token with a random
row); the leading correct tokens are kept (``num_accepted``) and the next step resumes there.
Every kept token's table rows and PLE term must equal the reference's at its position, and the
slot of each request's last kept token must hold the reference's context and conv state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from qwen38_plugin.ops import ple
from qwen38_plugin.ops.ple_varlen import ngram_rows_varlen, ple_mix_varlen
from qwen38_plugin.vllm_ple import step_parts
from tests.qwen38_plugin.qwen38_reference import rel_err
from tests.qwen38_plugin.test_qwen38_ple_varlen import (
    EOS,
    EPS,
    HALF_TOL,
    HC,
    HEADS_PER_NGRAM,
    NGRAM,
    SPAN,
    TOKEN_RANGE,
    WIDTH,
    Weights,
    _tokens,
    _weights,
)

FP32_TOL = 1e-6


@dataclass
class Seq:
    tokens: list[int]  # the true sequence
    streams: torch.Tensor  # [len, hc * H]: the true streams entering the PLE layer
    slots: list[int]  # [k + 1]
    prompt: int
    done: int = 0
    accepted: int = 1
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    terms: dict[int, torch.Tensor] = field(default_factory=dict)


def _metadata(entries: list[tuple[str, Seq, int]], num_spec: int) -> GDNAttentionMetadata:
    """vLLM's GDN metadata of the step (as `GDNAttentionMetadataBuilder.build` lays it out)."""
    lengths = torch.tensor([n for _, _, n in entries], dtype=torch.int32)
    num_tokens = int(lengths.sum())
    slots = torch.tensor([s.slots for _, s, _ in entries], dtype=torch.int32)
    spec = torch.tensor([kind == "spec" for kind, _, _ in entries])

    def starts(mask: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(int(mask.sum()) + 1, dtype=torch.int32)
        out[1:] = lengths[mask].cumsum(0)
        return out

    fresh = torch.tensor([s.done > 0 for kind, s, _ in entries if kind != "spec"])
    if not bool(spec.any()):
        return GDNAttentionMetadata(
            num_prefills=len(entries), num_prefill_tokens=num_tokens, num_decodes=0, num_decode_tokens=0,
            num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=num_tokens, has_initial_state=fresh,
            non_spec_query_start_loc=starts(~spec), non_spec_state_indices_tensor=slots[:, 0],
        )  # fmt: skip
    token_spec = torch.repeat_interleave(spec, lengths)
    order = torch.argsort(token_spec.int(), stable=True)
    num_other = int((~token_spec).sum())
    return GDNAttentionMetadata(
        num_prefills=int((~spec).sum()), num_prefill_tokens=num_other, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=int(spec.sum()), num_spec_decode_tokens=num_tokens - num_other, num_actual_tokens=num_tokens,
        has_initial_state=fresh, spec_query_start_loc=starts(spec), non_spec_query_start_loc=starts(~spec),
        spec_state_indices_tensor=slots[spec, : num_spec + 1], non_spec_state_indices_tensor=slots[~spec, 0],
        spec_sequence_masks=spec, spec_token_indx=order[num_other:].int(), non_spec_token_indx=order[:num_other].int(),
        num_accepted_tokens=torch.tensor([s.accepted for kind, s, _ in entries if kind == "spec"], dtype=torch.int32),
    )  # fmt: skip


def _layer_step(
    w: Weights, meta: GDNAttentionMetadata, ids: torch.Tensor, streams: torch.Tensor, conv: torch.Tensor,
    context: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """What `vllm_ple.PortablePLE.embed` then `.mix` do over a step: (table rows, term)."""
    num_tokens = ids.shape[0]
    rows = torch.zeros(num_tokens, len(w.head_vocab_sizes), dtype=torch.long)
    term = torch.zeros_like(streams)
    for part in step_parts(meta, conv, context):
        part_ids = part.take(ids)
        part_rows = ngram_rows_varlen(
            part_ids, part.token_req(part_ids.shape[0]), part.query_start, part.context_cache, part.state_indices,
            part.has_initial_state, w.multipliers, w.head_vocab_sizes, w.head_offsets,
            heads_per_ngram=HEADS_PER_NGRAM, eos_token_id=EOS, write_indices=part.write_indices,
        )  # fmt: skip
        part.put(rows, part_rows)
    embedded = F.embedding(rows, w.table).flatten(-2)
    key, value = F.linear(embedded, w.key_proj), F.linear(embedded, w.value_proj)
    for part in step_parts(meta, conv, context):
        part_streams = part.take(streams)
        part_term = ple_mix_varlen(
            part_streams, part.take(key), part.take(value), w.norm_key, w.norm_query, w.norm_conv, w.conv,
            part.conv_cache, part.token_req(part_streams.shape[0]), part.query_start, part.state_indices,
            part.has_initial_state, hc_count=HC, ngram_size=NGRAM, eps=EPS, write_indices=part.write_indices,
        )  # fmt: skip
        part.put(term, part_term)
    return rows, term


def _simulate(num_spec: int, dtype: torch.dtype, seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    w = _weights(dtype, gen)
    positions = num_spec + 1
    prompts = [1, 6, 3]
    slot_ids = list(range(1, len(prompts) * positions + 1))
    rng.shuffle(slot_ids)
    num_slots = len(slot_ids) + 1  # slot 0: vLLM's null block
    seqs = []
    for i, prompt in enumerate(prompts):
        n = prompt + 30
        seqs.append(
            Seq(
                _tokens(n, gen, eos_at=(min(prompt + 7, n - 1),)),
                torch.randn(n, WIDTH, generator=gen).to(dtype),
                slot_ids[i * positions : (i + 1) * positions],
                prompt,
            )
        )
    context = torch.randint(0, TOKEN_RANGE, (num_slots, NGRAM - 1), generator=gen)
    conv = torch.full((num_slots, WIDTH, SPAN), float("nan"), dtype=dtype)  # fresh slots may hold NaN
    conv[0] = 0.5
    null_context, null_conv = context[0].clone(), conv[0].clone()

    started: list[Seq] = []
    for step in range(40):
        entries: list[tuple[str, Seq, int]] = []
        drafts: dict[int, list[bool]] = {}
        for s in started:
            if s.done < len(s.tokens) - positions:
                num_drafts = rng.randint(0, num_spec)
                correct = rng.randint(0, num_drafts)
                drafts[id(s)] = [True] * (1 + correct) + [False] * (num_drafts - correct)
                entries.append(("spec", s, 1 + num_drafts))
        joining = seqs[:2] if step == 0 else ([seqs[2]] if step == 1 else [])
        entries += [("prefill", s, s.prompt) for s in joining]
        if not entries:
            break
        rng.shuffle(entries)
        ids_parts, stream_parts = [], []
        for kind, s, n in entries:
            if kind == "prefill":
                ids_parts.append(torch.tensor(s.tokens[:n]))
                stream_parts.append(s.streams[:n])
                continue
            keep = torch.tensor(drafts[id(s)])
            wrong_ids = torch.randint(0, TOKEN_RANGE, (n,), generator=gen)
            wrong_streams = torch.randn(n, WIDTH, generator=gen).to(dtype)
            ids_parts.append(torch.where(keep, torch.tensor(s.tokens[s.done : s.done + n]), wrong_ids))
            stream_parts.append(torch.where(keep[:, None], s.streams[s.done : s.done + n], wrong_streams))
        ids, streams = torch.cat(ids_parts), torch.cat(stream_parts)
        rows, term = _layer_step(w, _metadata(entries, num_spec), ids, streams, conv, context)
        start = 0
        for kind, s, n in entries:
            kept = n if kind == "prefill" else (drafts[id(s)] + [False]).index(False)
            for j in range(kept):
                s.rows[s.done + j], s.terms[s.done + j] = rows[start + j], term[start + j]
            s.done += kept
            s.accepted = 1 if kind == "prefill" else kept
            if kind == "prefill":
                started.append(s)
            start += n

    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL[dtype]
    for s in seqs:
        assert s.done > s.prompt + 12, "the simulation verified too few tokens"
        ids = torch.tensor(s.tokens[: s.done])[None]
        ref_rows, _ = ple.ngram_ids(
            ids, ple.initial_context(1, NGRAM, EOS), w.multipliers, w.head_vocab_sizes, w.head_offsets,
            heads_per_ngram=HEADS_PER_NGRAM, eos_token_id=EOS,
        )  # fmt: skip
        ref_term, ref_context, ref_conv = ple.ple(
            s.streams[None, : s.done], ids, w.table, w.multipliers, w.head_vocab_sizes, w.head_offsets, w.key_proj,
            w.value_proj, w.norm_key, w.norm_query, w.norm_conv, w.conv, hc_count=HC,
            heads_per_ngram=HEADS_PER_NGRAM, eos_token_id=EOS, eps=EPS,
        )  # fmt: skip
        assert torch.equal(torch.stack([s.rows[p] for p in range(s.done)]), ref_rows[0])
        assert rel_err(torch.stack([s.terms[p] for p in range(s.done)]), ref_term[0]) < tol
        last = s.slots[s.accepted - 1]
        assert torch.equal(context[last], ref_context[0])
        assert rel_err(conv[last], ref_conv[0]) < tol
    assert torch.equal(context[0], null_context) and torch.equal(conv[0], null_conv)


@pytest.mark.parametrize("num_spec", [1, 2, 4])
def test_verify_steps_with_rollback_match_the_reference(num_spec: int) -> None:
    _simulate(num_spec, torch.float32, seed=num_spec)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_verify_steps_in_half_precision(dtype: torch.dtype) -> None:
    _simulate(3, dtype, seed=7)


def test_verify_rows_need_no_host_values() -> None:
    # On the meta device no value exists: a host sync or a shape that depends on values raises.
    w = _weights(torch.float32, torch.Generator().manual_seed(8), device="meta")
    meta = torch.device("meta")
    context = torch.empty(9, NGRAM - 1, dtype=torch.long, device=meta)
    conv = torch.empty(9, WIDTH, SPAN, device=meta)
    qsl, read = torch.empty(4, dtype=torch.int32, device=meta), torch.empty(3, dtype=torch.int32, device=meta)
    write = torch.empty(3, 4, dtype=torch.int32, device=meta)
    token_req = torch.empty(8, dtype=torch.int32, device=meta)
    rows = ngram_rows_varlen(
        torch.empty(8, dtype=torch.long, device=meta), token_req, qsl[:-1], context, read, None, w.multipliers,
        w.head_vocab_sizes, w.head_offsets, heads_per_ngram=HEADS_PER_NGRAM, eos_token_id=EOS, write_indices=write,
    )  # fmt: skip
    embedded = F.embedding(rows, w.table).flatten(-2)
    term = ple_mix_varlen(
        torch.empty(8, WIDTH, device=meta), F.linear(embedded, w.key_proj), F.linear(embedded, w.value_proj),
        w.norm_key, w.norm_query, w.norm_conv, w.conv, conv, token_req, qsl[:-1], read, None, hc_count=HC,
        ngram_size=NGRAM, eps=EPS, write_indices=write,
    )  # fmt: skip
    assert term.shape == (8, WIDTH) and term.device == meta
    assert context.shape == (9, NGRAM - 1) and conv.shape == (9, WIDTH, SPAN)
