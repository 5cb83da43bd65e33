"""Normalisation and rotary embedding shared by several Qwen4Exp blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    """Qwen4Exp's RMSNorm: ``x / rms(x) * (1 + weight)``, computed in fp32, returned in ``x.dtype``.

    x: ``[..., D]``; weight: ``[D]``. With ``group_size`` the RMS is taken over each
    consecutive group of ``group_size`` features (the hyper-connection streams), not over D.
    """
    xf = x.float()
    if group_size is not None:
        xf = xf.unflatten(-1, (-1, group_size))
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if group_size is not None:
        normed = normed.flatten(-2)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def rotary_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[*positions.shape, rotary_dim]`` for the default (non-scaled) RoPE.

    Computed in fp32 and rounded to ``dtype`` (the model dtype), as the reference does;
    the two halves of the last dimension repeat the same frequencies (rotate-half layout).
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=positions.device) / rotary_dim)
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` features of every head of x; keep the rest.

    x: ``[T, heads, head_dim]``; cos, sin: ``[T, rotary_dim]`` with rotary_dim <= head_dim.
    """
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated_half * sin, rest], dim=-1)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None,
    activation: str | None = "silu",
    dilation: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal (optionally dilated) convolution continuing from ``state``.

    x: ``[B, T, C]``; weight: ``[C, K]``; state: ``[B, C, S]`` with ``S = (K - 1) * dilation``,
    the last S inputs (None: zeros). Returns (y ``[B, T, C]`` in x.dtype, new state ``[B, C, S]``).
    The convolution runs in ``weight.dtype``, as the reference does.
    """
    batch, seq_len, channels = x.shape
    span = (weight.shape[-1] - 1) * dilation
    xt = x.transpose(1, 2).to(weight.dtype)
    if state is None:
        state = xt.new_zeros(batch, channels, span)
    window = torch.cat([state.to(weight.dtype), xt], dim=-1)
    y = F.conv1d(window, weight.unsqueeze(1), groups=channels, dilation=dilation)[..., -seq_len:]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: unsupported activation {activation!r}; use 'silu' or None")
    new_state = window[..., window.shape[-1] - span :].contiguous()
    return y.transpose(1, 2).to(x.dtype), new_state


def write_slots_(cache: torch.Tensor, slots: torch.Tensor, written: torch.Tensor, values: torch.Tensor) -> None:
    """``cache[slots[r]] = values[r]`` for every r with ``written[r]``, as one index_copy_ of all R rows.

    cache: ``[S, ...]``; slots: ``[R]`` long, >= 0; written: ``[R]`` bool; values: ``[R, ...]``.
    With static shapes every row must go somewhere: a row not written repeats the first written
    row's write (same slot, same value), so the duplicate indices store identical bytes. If no
    row is written, every row rewrites slot ``slots[0]`` with what that slot already holds.
    """
    values = values.to(cache.dtype)
    first = torch.argmax(written.to(torch.int32)).view(1)  # the first written row; 0 if none
    first_slot = slots.index_select(0, first)
    first_value = torch.where(
        written.index_select(0, first).view((1,) * values.dim()),
        values.index_select(0, first),
        cache.index_select(0, first_slot),
    )
    target = torch.where(written, slots, first_slot)
    source = torch.where(written.view((-1,) + (1,) * (values.dim() - 1)), values, first_value)
    cache.index_copy_(0, target, source)
