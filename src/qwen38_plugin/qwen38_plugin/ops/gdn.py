"""Gated DeltaNet (the `linear_attention` layers): causal conv, gated delta rule, gated norm.

State per sequence:
- conv state ``[C, K - 1]``: the last K - 1 conv inputs (C = 2 * Hk * Dk + Hv * Dv channels);
- recurrent state ``[Hv, Dk, Dv]`` in fp32.
Both start at zero. Shapes use B sequences of T new tokens each; ``Hk``/``Hv`` are key and
value heads (Hv is a multiple of Hk), ``Dk``/``Dv`` their head sizes.

The delta rule per head, one token at a time (``recurrent`` form), is
``S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q`` with q, k L2-normalised and
q scaled by ``Dk ** -0.5``. The ``chunked`` form computes the same thing a chunk of tokens
at a time through a triangular solve, which is how prefill is done.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from qwen38_plugin.ops import gdn_cuda
from qwen38_plugin.ops.common import causal_conv1d

KERNELS = ("auto", "torch", "fla")
# The default of `gated_delta_net(kernels=None)`, e.g. QWEN38_GDN_KERNELS=torch to run the
# reference delta rule on CUDA inside a whole model for comparison.
KERNELS_ENV = "QWEN38_GDN_KERNELS"


def _use_fla(kernels: str | None, x: torch.Tensor) -> bool:
    if kernels is None:
        kernels = os.environ.get(KERNELS_ENV, "").strip() or "auto"
        if kernels not in KERNELS:
            raise ValueError(f"{KERNELS_ENV}={kernels!r}: use one of {', '.join(KERNELS)}")
    if kernels not in KERNELS:
        raise ValueError(f"gated_delta_net: kernels={kernels!r}; use one of {', '.join(KERNELS)}")
    if kernels == "torch" or (kernels == "auto" and not x.is_cuda):
        return False
    if gdn_cuda.fla_kernels() is None:
        if kernels == "fla":
            raise RuntimeError(f"gated_delta_net: kernels='fla' needs fla-core: {gdn_cuda.INSTALL_HINT}")
        gdn_cuda.warn_missing_once()
        return False
    return True


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    # Heads first, fp32, q and k unit length, q scaled: [B, H, T, D] and [B, H, T].
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (used for decode).

    q, k: ``[B, T, H, Dk]``; v: ``[B, T, H, Dv]``; g (log decay, <= 0), beta: ``[B, T, H]``;
    state: ``[B, H, Dk, Dv]`` (None: zeros). q and k are L2-normalised here.
    Returns (o ``[B, T, H, Dv]`` in v.dtype, final state ``[B, H, Dk, Dv]`` fp32).
    ``in_place``: the final state is ``state`` itself, updated (a contiguous fp32 state the
    caller gives away, e.g. a copy gathered from a cache: saves copying it once more).
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    batch, heads, seq_len, dk = k.shape
    dv = v.shape[-1]
    if state is None:
        s = q.new_zeros(batch, heads, dk, dv)
    elif in_place and state.dtype == torch.float32 and state.is_contiguous():
        s = state
    else:
        s = state.float().clone(memory_format=torch.contiguous_format)
    # The state is updated in place, one (head, sequence) matrix per batch entry: a decode step
    # is memory-bound on the state, and each line below reads it once (writing it at most once)
    # instead of materialising a new copy per operation.
    s3 = s.view(batch * heads, dk, dv)
    outputs = []
    for t in range(seq_len):
        k_t = k[:, :, t].reshape(batch * heads, 1, dk)
        s3.mul_(g[:, :, t].exp().reshape(batch * heads, 1, 1))
        predicted = torch.bmm(k_t, s3)
        delta = (v[:, :, t].reshape(batch * heads, 1, dv) - predicted) * beta[:, :, t].reshape(batch * heads, 1, 1)
        s3.baddbmm_(k_t.transpose(1, 2), delta)
        outputs.append(torch.bmm(q[:, :, t].reshape(batch * heads, 1, dk), s3).view(batch, heads, dv))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(batch, 0, heads, dv)
    return o.to(out_dtype), s


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule a chunk at a time (used for prefill); same contract as the recurrent form.

    Within a chunk with cumulative log decay ``G_i``, the corrections ``u`` solve
    ``(I + A) u = beta * v - beta * exp(G) k S0`` with ``A_ij = beta_i exp(G_i - G_j) k_i.k_j``
    for j < i; then ``o_i = exp(G_i) q_i S0 + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) u_j`` and
    ``S = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T``.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    batch, heads, seq_len, dk = k.shape
    dv = v.shape[-1]
    s = q.new_zeros(batch, heads, dk, dv) if state is None else state.float().clone()
    outputs = []
    for start in range(0, seq_len, chunk_size):
        end = min(start + chunk_size, seq_len)
        qc, kc, vc, bc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], beta[:, :, start:end]
        cum = g[:, :, start:end].cumsum(-1)  # [B, H, C]
        length = end - start
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        # exp(G_i - G_j) for j <= i; the upper triangle is masked before exp so it cannot overflow.
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        strict = decay.masked_fill(torch.eye(length, dtype=torch.bool, device=q.device), 0.0)
        system = torch.eye(length, device=q.device) + bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * strict
        rhs_v = bc[..., None] * vc
        rhs_s = (bc * cum.exp())[..., None] * kc
        u = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, rhs_s, upper=False, unitriangular=True)
        u = u - w @ s
        o = (cum.exp()[..., None] * qc) @ s + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        outputs.append(o)
        tail_decay = (cum[..., -1:] - cum).exp()  # exp(G_last - G_j)
        s = cum[..., -1, None, None].exp() * s + (kc * tail_decay[..., None]).transpose(-1, -2) @ u
    o_all = torch.cat(outputs, dim=2) if outputs else v.new_zeros(batch, heads, 0, dv)
    return o_all.transpose(1, 2).to(out_dtype), s


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str = "silu"
) -> torch.Tensor:
    """Per-head RMSNorm then output gate: ``weight * norm(x) * act(gate)``.

    x, gate: ``[..., Dv]``; weight: ``[Dv]`` (used as is, not ``1 + weight``). The normalised
    value is rounded to x.dtype before the weight, the gate is applied in fp32 (reference order).
    """
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if activation == "silu":
        act = F.silu(gate.float())
    elif activation == "sigmoid":
        act = torch.sigmoid(gate.float())
    else:
        raise ValueError(f"gated_rms_norm: unsupported output gate activation {activation!r}; use silu or sigmoid")
    return ((weight * normed) * act).to(x.dtype)


def gated_delta_net(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    eps: float,
    gate_activation: str = "silu",
    conv_state: torch.Tensor | None = None,
    recurrent_state: torch.Tensor | None = None,
    chunk_size: int | None = 64,
    kernels: str | None = None,
    state_in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Gated DeltaNet layer between its input and output projections.

    mixed_qkv: ``[B, T, 2 * Hk * Dk + Hv * Dv]`` (q, k, v in that order); z: ``[B, T, Hv * Dv]``;
    a, b: ``[B, T, Hv]``; conv_weight: ``[C, K]``; a_log, dt_bias: ``[Hv]``; norm_weight: ``[Dv]``.
    States as in the module docstring (None: zeros). ``chunk_size=None`` uses the recurrent form.
    Returns (y ``[B, T, Hv * Dv]`` for the output projection, conv state, recurrent state).
    Works on any subset of heads (tensor-parallel shards) as long as every tensor agrees.

    ``kernels``: "torch" runs the plain-torch delta rule above (the reference); "fla" runs
    flash-linear-attention's kernels (`ops.gdn_cuda`, CUDA tensors, fla-core installed);
    "auto" runs fla's on CUDA tensors when fla-core is installed (else torch, with a one-time
    warning naming the extra to install) and torch everywhere else. None (the default) reads
    ``QWEN38_GDN_KERNELS``, "auto" when unset. ``state_in_place``: the recurrent form may update
    ``recurrent_state`` in place (`gated_delta_rule_recurrent`'s ``in_place``).
    """
    batch, seq_len, _ = mixed_qkv.shape
    key_dim = num_k_heads * head_k_dim
    mixed_qkv, conv_state = causal_conv1d(mixed_qkv, conv_weight, conv_state)
    q, k, v = torch.split(mixed_qkv, [key_dim, key_dim, mixed_qkv.shape[-1] - 2 * key_dim], dim=-1)
    q = q.reshape(batch, seq_len, num_k_heads, head_k_dim)
    k = k.reshape(batch, seq_len, num_k_heads, head_k_dim)
    v = v.reshape(batch, seq_len, -1, head_v_dim)
    beta = b.sigmoid()
    # fp32: in fp16, exp(A_log) * softplus(.) can overflow to -inf.
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    if _use_fla(kernels, mixed_qkv):
        # fla maps value head j to key head j // (Hv // Hk) itself (the repeat below).
        o, recurrent_state = gdn_cuda.gated_delta_rule_fla(
            q, k, v, g, beta, recurrent_state, chunked=chunk_size is not None
        )
    else:
        repeat = v.shape[2] // num_k_heads
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        if chunk_size is None:
            o, recurrent_state = gated_delta_rule_recurrent(q, k, v, g, beta, recurrent_state, state_in_place)
        else:
            o, recurrent_state = gated_delta_rule_chunked(q, k, v, g, beta, recurrent_state, chunk_size)
    y = gated_rms_norm(o, z.reshape(batch, seq_len, -1, head_v_dim), norm_weight, eps, gate_activation)
    return y.reshape(batch, seq_len, -1), conv_state, recurrent_state
