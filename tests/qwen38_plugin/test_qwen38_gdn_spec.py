"""Speculative decoding in the CPU GDN core (`ops.gdn_varlen.gdn_core_spec` / `gdn_core_step`):
verify rows of 1 + drafts tokens with rollback through per-draft-position state slots and the
wide conv buffer, laid out by vLLM's own `GDNAttentionMetadata` (its spec fields), against the
reference op (`ops.gdn.gated_delta_net`) run token by token over each request's true sequence.

A simulated engine: requests prefill, then verify drafts step after step; each draft is either
the true next token (its input rows) or a wrong one (random rows). The verifier keeps the leading
correct tokens (``num_accepted``), and the next step resumes from there. Every kept token's output
must equal the reference's at its position, and at the end each request's slot of its last kept
token must hold the reference's states.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from qwen38_plugin.ops import gdn
from qwen38_plugin.ops.gdn_varlen import gdn_core_spec, gdn_core_step
from tests.qwen38_plugin.qwen38_reference import rel_err

K_HEADS, V_HEADS, DK, DV, KERNEL = 2, 4, 8, 6, 4
CHANNELS = 2 * K_HEADS * DK + V_HEADS * DV
NORM_EPS = 1e4  # as in test_qwen38_gdn_varlen: a nearly linear norm keeps each head's scale visible
# The verify rows run the same per-token recurrence as the reference; only the prefill's chunked
# form differs from a token-by-token run in fp32 rounding.
FP32_TOL = 1e-5
HALF_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _weights(dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    conv = (torch.randn(CHANNELS, KERNEL, generator=gen) * 0.5).to(dtype)
    a_log = torch.rand(V_HEADS, generator=gen).log().to(dtype)
    dt_bias = torch.randn(V_HEADS, generator=gen).to(dtype)
    return conv, a_log, dt_bias


def _rows(n: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mixed_qkv [n, C], a [n, Hv], b [n, Hv]): one token's layer inputs per row."""
    return (
        torch.randn(n, CHANNELS, generator=gen).to(dtype),
        torch.randn(n, V_HEADS, generator=gen).to(dtype),
        torch.randn(n, V_HEADS, generator=gen).to(dtype),
    )


@dataclass
class Seq:
    """A request: its true token rows, its slots and how far the engine has verified it."""

    true: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    slots: list[int]  # [k + 1] state slots (vLLM's block-table columns)
    prompt: int
    done: int = 0  # tokens whose outputs are final (kept)
    accepted: int = 1  # the previous verify step's num_accepted_tokens
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> core output


def _reference(seq: Seq, conv_w: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, upto: int) -> tuple:
    """The reference op over the true sequence: the prompt at once (chunked, as a prefill runs),
    then one token at a time. Returns (core output o [upto, Hv, Dv] before the norm, conv state
    [C, K - 1], recurrent state [Hv, Dk, Dv] fp32)."""
    mixed, a, b = (t[:upto] for t in seq.true)
    z = torch.ones(upto, V_HEADS * DV, dtype=mixed.dtype)
    conv_state = ssm_state = None
    outs = []
    pieces = [(0, seq.prompt)] + [(p, p + 1) for p in range(seq.prompt, upto)]
    for begin, end in pieces:
        o, conv_state, ssm_state = _core_reference(
            mixed[None, begin:end], z[None, begin:end], a[None, begin:end], b[None, begin:end], conv_w, a_log,
            dt_bias, conv_state, ssm_state, chunked=end - begin > 1,
        )  # fmt: skip
        outs.append(o[0])
    assert conv_state is not None and ssm_state is not None
    return torch.cat(outs), conv_state[0], ssm_state[0]


def _core_reference(mixed, z, a, b, conv_w, a_log, dt_bias, conv_state, ssm_state, *, chunked: bool) -> tuple:  # type: ignore[no-untyped-def]
    """`gdn.gated_delta_net` with the gated norm undone: the norm's weight is 1 and its gate
    silu(large) ~ 1, so the test compares normed outputs of both sides instead (`_normed`)."""
    y, conv_state, ssm_state = gdn.gated_delta_net(
        mixed, z * 30, a, b, conv_w, a_log, dt_bias, torch.ones(DV, dtype=mixed.dtype), num_k_heads=K_HEADS,
        head_k_dim=DK, head_v_dim=DV, eps=NORM_EPS, conv_state=conv_state, recurrent_state=ssm_state,
        chunk_size=64 if chunked else None, kernels="torch",
    )  # fmt: skip
    return y, conv_state, ssm_state


def _normed(o: torch.Tensor) -> torch.Tensor:
    """Our core output [T, Hv, Dv] through the same gated norm as `_core_reference`: [T, Hv * Dv]."""
    z = torch.full_like(o, 30.0)
    return gdn.gated_rms_norm(o, z, torch.ones(DV, dtype=o.dtype), NORM_EPS).flatten(-2)


def _metadata(rows: list[tuple[str, Seq, int]], num_spec: int, num_tokens: int) -> GDNAttentionMetadata:
    """vLLM's GDN metadata of a step whose requests are ``rows`` (kind "spec" or "prefill", request,
    token count), laid out as `GDNAttentionMetadataBuilder.build` lays it out."""
    lengths = torch.tensor([n for _, _, n in rows], dtype=torch.int32)
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl[1:] = lengths.cumsum(0)
    spec_mask = torch.tensor([kind == "spec" for kind, _, _ in rows])
    slots = torch.tensor([s.slots for _, s, _ in rows], dtype=torch.int32)
    num_spec_decodes = int(spec_mask.sum())
    num_prefills = len(rows) - num_spec_decodes
    if num_spec_decodes == 0:
        return GDNAttentionMetadata(
            num_prefills=num_prefills, num_prefill_tokens=num_tokens, num_decodes=0, num_decode_tokens=0,
            num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=num_tokens,
            has_initial_state=torch.tensor([s.done > 0 for _, s, _ in rows]),
            non_spec_query_start_loc=qsl, non_spec_state_indices_tensor=slots[:, 0],
        )  # fmt: skip
    token_mask = torch.repeat_interleave(spec_mask, lengths)
    order = torch.argsort(token_mask.int(), stable=True)
    num_non_spec_tokens = int((~token_mask).sum())

    def starts(mask: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(int(mask.sum()) + 1, dtype=torch.int32)
        out[1:] = lengths[mask].cumsum(0)
        return out

    return GDNAttentionMetadata(
        num_prefills=num_prefills, num_prefill_tokens=num_non_spec_tokens, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=num_spec_decodes, num_spec_decode_tokens=num_tokens - num_non_spec_tokens,
        num_actual_tokens=num_tokens,
        has_initial_state=torch.tensor([s.done > 0 for kind, s, _ in rows if kind != "spec"]),
        spec_query_start_loc=starts(spec_mask), non_spec_query_start_loc=starts(~spec_mask),
        spec_state_indices_tensor=slots[spec_mask, : num_spec + 1], non_spec_state_indices_tensor=slots[~spec_mask, 0],
        spec_sequence_masks=spec_mask, spec_token_indx=order[num_non_spec_tokens:].int(),
        non_spec_token_indx=order[:num_non_spec_tokens].int(),
        num_accepted_tokens=torch.tensor([s.accepted for kind, s, _ in rows if kind == "spec"], dtype=torch.int32),
    )  # fmt: skip


def _caches(num_slots: int, num_spec: int, dtype, ssm_dtype, dim_first: bool, gen) -> tuple:  # type: ignore[no-untyped-def]
    """The wide conv buffer and the ssm cache, strided views into larger buffers, full of garbage."""
    state_len = KERNEL - 1 + num_spec
    conv_numel, ssm_numel = state_len * CHANNELS, V_HEADS * DV * DK
    conv_buf = torch.randn(num_slots, conv_numel + 5, generator=gen).to(dtype)
    ssm_buf = torch.randn(num_slots, ssm_numel + 3, generator=gen).to(ssm_dtype)
    shape = (CHANNELS, state_len) if dim_first else (state_len, CHANNELS)
    conv = conv_buf[:, 2 : 2 + conv_numel].view(num_slots, *shape)
    ssm = ssm_buf[:, 1 : 1 + ssm_numel].view(num_slots, V_HEADS, DV, DK)
    return conv, ssm


def _simulate(num_spec: int, dtype: torch.dtype, ssm_dtype: torch.dtype, dim_first: bool, seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    weights = _weights(dtype, gen)
    positions = num_spec + 1
    prompts = [1, 5, 70, 3]
    total = [p + 24 for p in prompts]
    slot_ids = list(range(1, len(prompts) * positions + 1))
    rng.shuffle(slot_ids)  # slot 0 is vLLM's null block: nobody's
    seqs = [
        Seq(_rows(total[i], dtype, gen), slot_ids[i * positions : (i + 1) * positions], prompts[i])
        for i in range(len(prompts))
    ]
    conv, ssm = _caches(len(slot_ids) + 1, num_spec, dtype, ssm_dtype, dim_first, gen)
    conv[1:], ssm[1:] = float("nan"), float("nan")  # fresh slots may hold NaN; it must not leak
    null_conv, null_ssm = conv[0].clone(), ssm[0].clone()
    heads = {"num_k_heads": K_HEADS, "head_k_dim": DK, "head_v_dim": DV, "conv_state_dim_first": dim_first}

    # Step 0: the first two requests prefill alone (no verify rows: the non-spec metadata).
    # Later steps: the others join as prefills next to verify rows (vLLM's mixed layout).
    started: list[Seq] = []
    for step in range(30):
        rows: list[tuple[str, Seq, int]] = []
        drafts: dict[int, list[bool]] = {}
        joining = seqs[:2] if step == 0 else ([seqs[step + 1]] if step in (1, 2) else [])
        live = [s for s in started if s.done < len(s.true[0]) - positions]
        for s in live:
            num_drafts = rng.randint(0, num_spec)
            correct = rng.randint(0, num_drafts)
            drafts[id(s)] = [True] * (1 + correct) + [False] * (num_drafts - correct)
            rows.append(("spec", s, 1 + num_drafts))
        for s in joining:
            rows.append(("prefill", s, s.prompt))
        if not rows:
            break
        rng.shuffle(rows)
        pieces = []
        for kind, s, n in rows:
            if kind == "prefill":
                pieces.append(tuple(t[: s.prompt] for t in s.true))
            else:
                kept = drafts[id(s)]
                true = tuple(t[s.done : s.done + n] for t in s.true)
                wrong = _rows(n, dtype, gen)
                keep = torch.tensor(kept)
                pieces.append(tuple(torch.where(keep[:, None], tr, wr) for tr, wr in zip(true, wrong, strict=True)))
        step_inputs = [torch.cat([p[i] for p in pieces]) for i in range(3)]
        num_tokens = step_inputs[0].shape[0]
        padding = _rows(2, dtype, gen)  # rows past the step's tokens (vLLM pads a step)
        mixed, a, b = (torch.cat([x, pad]) for x, pad in zip(step_inputs, padding, strict=True))
        meta = _metadata(rows, num_spec, num_tokens)
        o = gdn_core_step(mixed, a, b, *weights, conv, ssm, meta, **heads)
        assert o.shape == (num_tokens + 2, V_HEADS, DV)
        assert torch.equal(o[num_tokens:], torch.zeros_like(o[num_tokens:]))
        start = 0
        for kind, s, n in rows:
            if kind == "prefill":
                for j in range(n):
                    s.outputs[j] = o[start + j]
                s.done, s.accepted = s.prompt, 1
                started.append(s)
            else:
                accepted = drafts[id(s)].index(False) if False in drafts[id(s)] else n
                for j in range(accepted):
                    s.outputs[s.done + j] = o[start + j]
                s.done += accepted
                s.accepted = accepted
            start += n

    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL[dtype]
    for s in seqs:
        assert s.done > s.prompt + 10, "the simulation verified too few tokens"
        expected, conv_ref, ssm_ref = _reference(s, *weights, upto=s.done)
        ours = _normed(torch.stack([s.outputs[p] for p in range(s.done)]))
        assert rel_err(ours, expected) < tol, (s.prompt, rel_err(ours, expected))
        # The states of the last kept token: recurrent in its slot, conv in the buffer at its column.
        last = s.accepted - 1
        ssm_tol = tol if ssm_dtype == torch.float32 else HALF_TOL.get(ssm_dtype, tol)
        assert rel_err(ssm[s.slots[last]].transpose(-1, -2), ssm_ref) < ssm_tol
        buffer = conv[s.slots[0]] if dim_first else conv[s.slots[0]].t()
        assert torch.equal(buffer[:, last : last + KERNEL - 1], conv_ref.to(dtype))
    assert torch.equal(conv[0].view(torch.uint8), null_conv.view(torch.uint8))  # the null block: untouched
    assert torch.equal(ssm[0].view(torch.uint8), null_ssm.view(torch.uint8))


@pytest.mark.parametrize("num_spec", [1, 2, 4])
def test_verify_steps_with_rollback_match_token_by_token_reference(num_spec: int) -> None:
    _simulate(num_spec, torch.float32, torch.float32, dim_first=False, seed=num_spec)


@pytest.mark.parametrize(
    ("dtype", "ssm_dtype", "dim_first"),
    [
        (torch.float32, torch.float32, True),
        (torch.bfloat16, torch.float32, False),
        (torch.float16, torch.float16, True),
    ],
)
def test_verify_steps_in_every_dtype_and_conv_layout(
    dtype: torch.dtype, ssm_dtype: torch.dtype, dim_first: bool
) -> None:
    _simulate(3, dtype, ssm_dtype, dim_first, seed=11)


def test_padded_verify_rows_write_nothing() -> None:
    # vLLM's full-graph staging pads verify rows with no tokens on the null block 0 (and
    # PAD_SLOT_ID rows may appear): their slots stay as they are, their outputs are zero.
    gen = torch.Generator().manual_seed(5)
    conv_w, a_log, dt_bias = _weights(torch.float32, gen)
    conv, ssm = _caches(8, 2, torch.float32, torch.float32, False, gen)
    before = conv.clone(), ssm.clone()
    mixed, a, b = _rows(3, torch.float32, gen)
    o = gdn_core_spec(
        mixed, a, b, conv_w, a_log, dt_bias, conv, ssm,
        torch.tensor([[0, 0, 0], [-1, -1, -1]], dtype=torch.int32), torch.tensor([0, 0, 0], dtype=torch.int32),
        torch.tensor([1, 1], dtype=torch.int32), num_k_heads=K_HEADS, head_k_dim=DK, head_v_dim=DV,
        conv_state_dim_first=False,
    )  # fmt: skip
    assert torch.equal(o, torch.zeros_like(o))
    assert torch.equal(conv, before[0]) and torch.equal(ssm, before[1])


def test_wrong_buffer_width_is_refused() -> None:
    gen = torch.Generator().manual_seed(6)
    conv_w, a_log, dt_bias = _weights(torch.float32, gen)
    conv, ssm = _caches(4, 1, torch.float32, torch.float32, False, gen)  # a buffer for 1 speculative token
    mixed, a, b = _rows(3, torch.float32, gen)
    with pytest.raises(ValueError, match=r"expected .* for kernel 4 and 2 speculative tokens"):
        gdn_core_spec(
            mixed, a, b, conv_w, a_log, dt_bias, conv, ssm, torch.tensor([[1, 2, 3]], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), num_k_heads=K_HEADS,
            head_k_dim=DK, head_v_dim=DV, conv_state_dim_first=False,
        )  # fmt: skip


def test_verify_rows_need_no_host_values() -> None:
    # On the meta device no value exists: a host sync or a shape that depends on values raises.
    # The caches are updated in place, so their shapes must come back unchanged.
    meta = torch.device("meta")
    conv_w, a_log, dt_bias = (t.to(meta) for t in _weights(torch.float32, torch.Generator().manual_seed(7)))
    conv = torch.empty(9, KERNEL - 1 + 2, CHANNELS, device=meta)
    ssm = torch.empty(9, V_HEADS, DV, DK, device=meta)
    mixed, a, b = (torch.empty(7, n, device=meta) for n in (CHANNELS, V_HEADS, V_HEADS))
    o = gdn_core_spec(
        mixed, a, b, conv_w, a_log, dt_bias, conv, ssm, torch.empty(3, 3, dtype=torch.int32, device=meta),
        torch.empty(4, dtype=torch.int32, device=meta), torch.empty(3, dtype=torch.int32, device=meta),
        num_k_heads=K_HEADS, head_k_dim=DK, head_v_dim=DV, conv_state_dim_first=False,
    )  # fmt: skip
    assert o.shape == (7, V_HEADS, DV) and o.device == meta
    assert conv.shape == (9, KERNEL + 1, CHANNELS) and ssm.shape == (9, V_HEADS, DV, DK)
