"""The gated delta rule on CUDA through flash-linear-attention's Triton kernels (`fla-core`).

The field's kernels, not new ones: `chunk_gated_delta_rule` for prefill chunks and
`fused_recurrent_gated_delta_rule` for decode steps, from the `fla-core` package (install the
plugin's ``[cuda]`` extra). They compute exactly the plain-torch `ops.gdn` forms (L2-normalised
q and k, q scaled by ``Dk ** -0.5``, fp32 recurrent state), which stay the reference and the CPU
path; `ops.gdn.gated_delta_net` calls this module for CUDA tensors.

Value heads may outnumber key heads (grouped value attention): value head ``j`` reads key head
``j // (Hv // Hk)``, the same mapping as ``repeat_interleave`` in the reference, so q and k are
passed unrepeated. Imports neither vLLM nor, until first use, fla.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

logger = logging.getLogger("vllm.plugins.qwen38_plugin")

INSTALL_HINT = "install it with `pip install 'vllm-qwen38-plugin[cuda]'` (fla-core)"


@cache
def fla_kernels() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """(chunk, fused_recurrent) from fla-core, or None when fla-core is not installed."""
    try:
        module = importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError:
        return None
    return module.chunk_gated_delta_rule, module.fused_recurrent_gated_delta_rule


@cache
def warn_missing_once() -> None:
    logger.warning(
        "qwen38_plugin: fla-core is not installed, so Gated DeltaNet runs the plain-torch delta rule on "
        "CUDA (correct, slower); %s",
        INSTALL_HINT,
    )


def gated_delta_rule_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    *,
    chunked: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule through fla's kernels; same contract as `ops.gdn.gated_delta_rule_recurrent`.

    q, k: ``[B, T, Hk, Dk]`` (not normalised); v: ``[B, T, Hv, Dv]`` with Hv a multiple of Hk;
    g (log decay), beta: ``[B, T, Hv]``; state: ``[B, Hv, Dk, Dv]`` (None: zeros).
    Returns (o ``[B, T, Hv, Dv]`` in v.dtype, final state ``[B, Hv, Dk, Dv]`` fp32).
    ``chunked`` picks the chunked kernel (prefill) or the fused recurrent one (decode).
    """
    kernels = fla_kernels()
    if kernels is None:
        raise RuntimeError(f"the fla Gated DeltaNet kernels need fla-core: {INSTALL_HINT}")
    if not q.is_cuda:
        raise ValueError(f"the fla Gated DeltaNet kernels run on CUDA tensors, got q on {q.device}")
    chunk, recurrent = kernels
    batch, _, heads_v, dk = v.shape[0], v.shape[1], v.shape[2], q.shape[-1]
    if state is None:
        state = torch.zeros(batch, heads_v, dk, v.shape[-1], dtype=torch.float32, device=v.device)
    args = dict(
        initial_state=state.float().contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        scale=dk**-0.5,
    )
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    g = g.float().contiguous()
    if chunked:
        o, final = chunk(q, k, v, g, beta, **args)
    else:
        o, final = recurrent(q, k, v, g=g, beta=beta, **args)
    return o.to(v.dtype), final.float()
