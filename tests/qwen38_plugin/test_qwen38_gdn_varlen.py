"""`ops.gdn_varlen.gdn_core_varlen` (a whole engine step on vLLM's state slots) against the
reference `ops.gdn.gated_delta_net` run request by request."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from qwen38_plugin.ops import gdn
from qwen38_plugin.ops.gdn_varlen import gdn_core_varlen
from tests.qwen38_plugin.qwen38_reference import rel_err

K_HEADS, V_HEADS, DK, DV, KERNEL = 2, 4, 8, 6, 4
CHANNELS = 2 * K_HEADS * DK + V_HEADS * DV
SLOTS = 16
# The reference op ends with the gated RMSNorm, which the varlen core leaves to the layer. The
# tests apply that same norm to our output; with this large eps it is nearly linear
# (x / sqrt(mean x^2 + eps)), so the comparison still sees the scale of each head's output.
NORM_EPS = 1e4
# fp32: the padded prefill batch only adds exact zeros to the reference's sums, but the matrix
# products run over other shapes (seen: 2.4e-7).
FP32_TOL = 2e-6
# Half precisions: q, k, v, beta and o round where the reference rounds them, so outputs differ
# by at most an ulp or two of the format (seen: 0 and 4.5e-5) and fp32 states by fp32 rounding
# (seen: 1.7e-6; a state rounded to the half dtype within a step would be ~1e-3 off).
HALF_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
HALF_FP32_STATE_TOL = 2e-5


@dataclass
class Weights:
    conv: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor


def _weights(dtype: torch.dtype, gen: torch.Generator) -> Weights:
    return Weights(
        conv=(torch.randn(CHANNELS, KERNEL, generator=gen) * 0.5).to(dtype),
        a_log=torch.rand(V_HEADS, generator=gen).log().to(dtype),
        dt_bias=torch.randn(V_HEADS, generator=gen).to(dtype),
        norm=torch.ones(DV, dtype=dtype),
    )


def _caches(
    dtype: torch.dtype, ssm_dtype: torch.dtype, dim_first: bool, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random conv and ssm caches, each a strided view into a wider buffer (as vLLM binds them)."""
    conv_numel, ssm_numel = (KERNEL - 1) * CHANNELS, V_HEADS * DV * DK
    conv_buf = torch.randn(SLOTS, conv_numel + 7, generator=gen).to(dtype)
    ssm_buf = torch.randn(SLOTS, ssm_numel + 5, generator=gen).to(ssm_dtype)
    conv_shape = (CHANNELS, KERNEL - 1) if dim_first else (KERNEL - 1, CHANNELS)
    conv = conv_buf[:, 3 : 3 + conv_numel].view(SLOTS, *conv_shape)
    ssm = ssm_buf[:, 2 : 2 + ssm_numel].view(SLOTS, V_HEADS, DV, DK)
    assert not conv.is_contiguous() and not ssm.is_contiguous()
    return conv, ssm


def _conv_slot(conv: torch.Tensor, slot: int, dim_first: bool) -> torch.Tensor:
    """A slot's conv state in the reference layout [C, K - 1]."""
    return conv[slot] if dim_first else conv[slot].t()


@dataclass
class Request:
    length: int  # tokens this step (0: a padded request)
    slot: int  # -1: PAD_SLOT_ID
    continues: bool


def _reference_step(
    requests: list[Request],
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    w: Weights,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    dim_first: bool,
) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The reference op per request: (y [N, Hv * Dv], {slot: (conv [C, K-1], ssm [Hv, Dk, Dv] fp32)})."""
    y = torch.zeros(mixed_qkv.shape[0], V_HEADS * DV, dtype=mixed_qkv.dtype)
    states = {}
    start = 0
    for req in requests:
        rows = slice(start, start + req.length)
        start += req.length
        if req.slot < 0 or req.length == 0:
            continue
        conv0 = _conv_slot(conv, req.slot, dim_first)[None].clone() if req.continues else None
        ssm0 = ssm[req.slot].transpose(-1, -2)[None].float() if req.continues else None
        y_r, conv_r, ssm_r = gdn.gated_delta_net(
            mixed_qkv[None, rows], z[None, rows], a[None, rows], b[None, rows], w.conv, w.a_log, w.dt_bias, w.norm,
            num_k_heads=K_HEADS, head_k_dim=DK, head_v_dim=DV, eps=NORM_EPS, conv_state=conv0,
            recurrent_state=ssm0, chunk_size=None if req.length == 1 else 64, kernels="torch",
        )  # fmt: skip
        y[rows] = y_r[0]
        states[req.slot] = (conv_r[0], ssm_r[0])
    return y, states


def _ours_step(
    requests: list[Request],
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    w: Weights,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    dim_first: bool,
    flags: bool = True,
) -> torch.Tensor:
    """Our op over the whole step, then the layer's gated norm: y [N, Hv * Dv]."""
    starts = [0]
    for req in requests:
        starts.append(starts[-1] + req.length)
    o = gdn_core_varlen(
        mixed_qkv, a, b, w.conv, w.a_log, w.dt_bias, conv, ssm,
        torch.tensor([r.slot for r in requests], dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
        torch.tensor([r.continues for r in requests]) if flags else None,
        num_k_heads=K_HEADS, head_k_dim=DK, head_v_dim=DV, conv_state_dim_first=dim_first,
    )  # fmt: skip
    assert o.shape == (mixed_qkv.shape[0], V_HEADS, DV) and o.dtype == mixed_qkv.dtype
    y = gdn.gated_rms_norm(o, z.unflatten(-1, (V_HEADS, DV)), w.norm, NORM_EPS)
    return y.flatten(-2)


def _inputs(num_tokens: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    mixed_qkv = torch.randn(num_tokens, CHANNELS, generator=gen).to(dtype)
    z = (torch.rand(num_tokens, V_HEADS * DV, generator=gen) + 5).to(dtype)
    a, b = (torch.randn(num_tokens, V_HEADS, generator=gen).to(dtype) for _ in range(2))
    return mixed_qkv, z, a, b


# Decodes, a 2-token chunk, around the 64-token chunk boundary and beyond two chunks; continuing
# and fresh; a PAD_SLOT_ID entry and a zero-length padded request on the null block 0. Order and
# slots shuffled (vLLM puts decodes first; the op must not rely on it).
STEP = [
    Request(1, 7, True),
    Request(63, 3, False),
    Request(2, 11, True),
    Request(1, 1, True),
    Request(130, 14, True),
    Request(64, 5, False),
    Request(1, 9, False),  # a fresh one-token prompt: recurrent form from zeros
    Request(65, 12, True),
    Request(4, -1, True),  # PAD_SLOT_ID: skipped, its rows stay zero
    Request(0, 0, False),  # a padded request: no tokens, null block 0 untouched
]


@pytest.mark.parametrize(
    ("dtype", "ssm_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
def test_step_matches_reference_per_request(dtype: torch.dtype, ssm_dtype: torch.dtype, dim_first: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    w = _weights(dtype, gen)
    conv, ssm = _caches(dtype, ssm_dtype, dim_first, gen)
    for req in STEP:
        if req.slot >= 0 and not req.continues:
            # a fresh request's slot holds garbage; NaN would leak through a multiply-by-zero
            conv[req.slot], ssm[req.slot] = float("nan"), float("nan")
    num_tokens = sum(r.length for r in STEP)
    mixed_qkv, z, a, b = _inputs(num_tokens + 3, dtype, gen)  # 3 trailing rows past the step: vLLM's padding
    conv_before, ssm_before = conv.clone(), ssm.clone()

    expected, states = _reference_step(STEP, mixed_qkv, z, a, b, w, conv_before, ssm_before, dim_first)
    ours = _ours_step(STEP, mixed_qkv, z, a, b, w, conv, ssm, dim_first)

    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL[dtype]
    assert rel_err(ours, expected) < tol
    padded = torch.zeros(num_tokens + 3, dtype=torch.bool)
    padded[num_tokens - 4 :] = True  # the PAD_SLOT_ID request's 4 tokens and the 3 trailing rows
    assert torch.equal(ours[padded], torch.zeros_like(ours[padded]))
    for slot in range(SLOTS):
        if slot in states:
            conv_ref, ssm_ref = states[slot]
            assert rel_err(_conv_slot(conv, slot, dim_first), conv_ref) == 0.0  # raw inputs, copied
            if ssm_dtype != torch.float32:
                ssm_tol = HALF_TOL[dtype]  # the reference's fp32 state, rounded once
            else:
                ssm_tol = FP32_TOL if dtype == torch.float32 else HALF_FP32_STATE_TOL
            assert rel_err(ssm[slot].transpose(-1, -2), ssm_ref.to(ssm_dtype)) < ssm_tol
        else:  # not a request's slot (the null block 0 included): untouched, bit for bit
            assert torch.equal(conv[slot].view(torch.uint8), conv_before[slot].view(torch.uint8))
            assert torch.equal(ssm[slot].view(torch.uint8), ssm_before[slot].view(torch.uint8))


def test_no_flags_means_every_request_continues() -> None:
    # vLLM passes has_initial_state=None for a step without prefills: all decodes continue.
    gen = torch.Generator().manual_seed(1)
    w = _weights(torch.float32, gen)
    conv, ssm = _caches(torch.float32, torch.float32, False, gen)
    step = [Request(1, 4, True), Request(1, 2, True), Request(1, 9, True)]
    mixed_qkv, z, a, b = _inputs(3, torch.float32, gen)
    expected, states = _reference_step(step, mixed_qkv, z, a, b, w, conv.clone(), ssm.clone(), False)
    ours = _ours_step(step, mixed_qkv, z, a, b, w, conv, ssm, False, flags=False)
    assert rel_err(ours, expected) < FP32_TOL
    for slot, (_, ssm_ref) in states.items():
        assert rel_err(ssm[slot].transpose(-1, -2), ssm_ref) < FP32_TOL


def test_multi_step_continuation_equals_one_long_run() -> None:
    # Two requests over four engine steps (prefill chunk, chunk, decodes), each step next to a
    # different companion request, against the reference over each whole sequence at once.
    gen = torch.Generator().manual_seed(2)
    w = _weights(torch.float32, gen)
    conv, ssm = _caches(torch.float32, torch.float32, False, gen)
    long_a, long_b = 40 + 70 + 3, 5 + 1 + 3
    seq_a, seq_b = _inputs(long_a, torch.float32, gen), _inputs(long_b, torch.float32, gen)
    # (tokens of A, tokens of B) per step; A lives in slot 6, B in slot 2
    plan = [(40, 5), (70, 1), (1, 1), (1, 1), (1, 1)]
    done_a = done_b = 0
    outs_a, outs_b = [], []
    for step, (n_a, n_b) in enumerate(plan):
        companion = _inputs(3, torch.float32, gen)
        requests = [Request(n_b, 2, step > 0), Request(3, 10, False), Request(n_a, 6, step > 0)]
        pieces = [
            [t[done_b : done_b + n_b] for t in seq_b],
            list(companion),
            [t[done_a : done_a + n_a] for t in seq_a],
        ]
        mixed_qkv, z, a, b = (torch.cat([p[i] for p in pieces]) for i in range(4))
        y = _ours_step(requests, mixed_qkv, z, a, b, w, conv, ssm, False)
        outs_b.append(y[:n_b])
        outs_a.append(y[n_b + 3 :])
        done_a, done_b = done_a + n_a, done_b + n_b
    for seq, outs, slot in ((seq_a, outs_a, 6), (seq_b, outs_b, 2)):
        mixed_qkv, z, a, b = (t[None] for t in seq)
        expected, conv_ref, ssm_ref = gdn.gated_delta_net(
            mixed_qkv, z, a, b, w.conv, w.a_log, w.dt_bias, w.norm, num_k_heads=K_HEADS, head_k_dim=DK,
            head_v_dim=DV, eps=NORM_EPS, chunk_size=64, kernels="torch",
        )  # fmt: skip
        # chunks aligned differently from the single run: equal up to fp32 rounding
        assert rel_err(torch.cat(outs), expected[0]) < 1e-5
        assert rel_err(conv[slot].t(), conv_ref[0]) == 0.0
        assert rel_err(ssm[slot].transpose(-1, -2), ssm_ref[0]) < 1e-5
