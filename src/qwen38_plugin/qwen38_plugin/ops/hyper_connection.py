"""Hyper-connections: ``hc`` residual streams of width H around every block.

The residual state of a token is ``[hc * H]`` (the streams side by side). Before a block, a
mixer reads it: grouped RMSNorm (per stream), a low-rank gate ``sigmoid(up(silu(down(n) / hc)))``
per feature, and the mean over streams of ``gate * n`` is the block input ``[H]``. After the
block, its output ``[H]`` is added to each stream s scaled by the injection weight
``2 * sigmoid(inject(n) / hc)[s]``. The final mixer (before lm_head) has no injection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen38_plugin.ops.common import rms_norm


def hc_mix(
    streams: torch.Tensor,
    norm_weight: torch.Tensor,
    down_weight: torch.Tensor,
    up_weight: torch.Tensor,
    inject_weight: torch.Tensor | None,
    *,
    hc_count: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read the block input from the streams.

    streams: ``[..., hc * H]``; norm_weight: ``[hc * H]``; down_weight: ``[R, hc * H]``;
    up_weight: ``[hc * H, R]``; inject_weight: ``[hc, hc * H]`` or None (final mixer).
    Returns (block input ``[..., H]``, injection weights ``[..., hc]`` or None).
    """
    hidden = streams.shape[-1] // hc_count
    normed = rms_norm(streams, norm_weight, eps, group_size=hidden)
    gate = torch.sigmoid(F.linear(F.silu(F.linear(normed, down_weight) / hc_count), up_weight))
    mixed = (gate.unflatten(-1, (hc_count, hidden)) * normed.unflatten(-1, (hc_count, hidden))).mean(dim=-2)
    if inject_weight is None:
        return mixed, None
    return mixed, 2 * torch.sigmoid(F.linear(normed, inject_weight) / hc_count)


def hc_inject(streams: torch.Tensor, block_output: torch.Tensor, injection: torch.Tensor) -> torch.Tensor:
    """streams ``[..., hc * H]`` + block_output ``[..., H]`` scaled per stream by injection ``[..., hc]``."""
    return streams + (block_output.unsqueeze(-2) * injection.unsqueeze(-1)).flatten(-2)


def hc_expand(embeddings: torch.Tensor, hc_count: int) -> torch.Tensor:
    """The initial residual state: every stream starts as the token embedding ``[..., H]``."""
    return embeddings.repeat(*([1] * (embeddings.dim() - 1)), hc_count)


def hc_mean(streams: torch.Tensor, hc_count: int) -> torch.Tensor:
    """The mean over the residual streams, ``[..., hc * H]`` -> ``[..., H]``: the target feature a
    DFlash drafter for a hyper-connection model reads (``target_feature_reduction = "hc_mean"``)."""
    *lead, width = streams.shape
    return streams.view(*lead, hc_count, width // hc_count).mean(dim=-2)
