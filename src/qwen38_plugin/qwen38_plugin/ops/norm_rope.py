"""Per-head RMSNorm followed by partial rotary embedding, as one op (QSA's queries and keys).

The reference is the composition of `common.rms_norm` and `common.apply_partial_rope`, which
launches about fifteen small kernels on CUDA; the Triton kernel reads each head once and writes
it once, rounding to the model dtype wherever the reference rounds (the normed head, each rotary
product and their sum), so it differs from the reference only by the order of the sum of
squares. One dispatcher picks by device (`triton_dispatch`; ``QWEN38_NORM_ROPE_REFERENCE=1``
keeps the reference on CUDA).
"""

from __future__ import annotations

import torch

from qwen38_plugin.ops import triton_dispatch
from qwen38_plugin.ops.common import apply_partial_rope, rms_norm
from qwen38_plugin.ops.triton_dispatch import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

REFERENCE_ENV = "QWEN38_NORM_ROPE_REFERENCE"


def rms_norm_rope_torch(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    return apply_partial_rope(rms_norm(x, weight, eps), cos, sin)


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``apply_partial_rope(rms_norm(x, weight, eps), cos, sin)``.

    x: ``[T, heads, D]`` (any strides with a unit last stride, e.g. a view of a fused projection);
    weight: ``[D]``; cos, sin: ``[T, rotary_dim]`` with rotary_dim even and <= D.
    Returns a new contiguous ``[T, heads, D]`` in x's dtype."""
    if not triton_dispatch.use_triton(x.is_cuda, backend, reference_env=REFERENCE_ENV, op="rms_norm_rope"):
        return rms_norm_rope_torch(x, weight, cos, sin, eps)
    tokens, heads, dim = x.shape
    rotary_dim = cos.shape[-1]
    if x.stride(2) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rms_norm_rope: the last dimension of x, cos and sin must be contiguous")
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        _rms_norm_rope_kernel[(tokens, heads)](
            x, weight, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), dim, rotary_dim, eps,
            BLOCK_D=triton.next_power_of_2(dim),
        )  # fmt: skip
    return out


if HAVE_TRITON:

    @triton.jit
    def _rms_norm_rope_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        weight_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        stride_token,
        stride_head,
        stride_cos,
        stride_sin,
        dim,
        rotary_dim,
        eps,
        BLOCK_D: tl.constexpr,
    ):
        # One program per (token, head). The rotate-half partner of feature i (i +- rotary_dim/2)
        # is normalised again from its own load: the same arithmetic, so the same rounded value.
        token = tl.program_id(0)
        head = tl.program_id(1)
        cols = tl.arange(0, BLOCK_D)
        ok = cols < dim
        row = x_ptr + token * stride_token + head * stride_head
        x = tl.load(row + cols, mask=ok, other=0.0)
        dtype = x.dtype
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / dim + eps)
        weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        normed = (xf * rstd * (1.0 + weight)).to(dtype)
        half = rotary_dim // 2
        rotary = cols < rotary_dim
        first = cols < half
        partner = tl.where(first, cols + half, cols - half)
        xp = tl.load(row + partner, mask=ok & rotary, other=0.0).to(tl.float32)
        wp = tl.load(weight_ptr + partner, mask=ok & rotary, other=0.0).to(tl.float32)
        normed_partner = (xp * rstd * (1.0 + wp)).to(dtype).to(tl.float32)
        rotated = tl.where(first, -normed_partner, normed_partner)
        cos = tl.load(cos_ptr + token * stride_cos + cols, mask=ok & rotary, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_sin + cols, mask=ok & rotary, other=0.0).to(tl.float32)
        nf = normed.to(tl.float32)
        turned = ((nf * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_ptr + (token * tl.num_programs(1) + head) * dim + cols, tl.where(rotary, turned, normed), mask=ok)
