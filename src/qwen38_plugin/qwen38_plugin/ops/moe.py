"""Sparse MoE block: softmax top-k routing (renormalised) plus a sigmoid-gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(
    x: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[N, H]``, router_weight ``[E, H]`` -> (weights ``[N, k]`` in x.dtype, expert ids ``[N, k]``).

    Softmax over all experts in fp32, keep the k largest, optionally renormalise them to sum 1.
    """
    probs = torch.softmax(F.linear(x, router_weight).float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``; gate_up: ``[2 * I, H]`` (gate rows first); down: ``[H, I]``."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def routed_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts_gate_up: torch.Tensor, experts_down: torch.Tensor
) -> torch.Tensor:
    """The routed part of an `ExpertsKernel`, as reference: each chosen expert's SwiGLU MLP on its
    tokens, weighted and summed."""
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        y = swiglu_mlp(x[token], experts_gate_up[expert], experts_down[expert])
        out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out


def moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    experts_gate_up: torch.Tensor,
    experts_down: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    shared_expert_gate: torch.Tensor,
    *,
    top_k: int,
    normalize: bool,
) -> torch.Tensor:
    """The MoE block for tokens x ``[N, H]``.

    experts_gate_up: ``[E, 2 * I, H]``; experts_down: ``[E, H, I]``; shared_gate_up: ``[2 * Is, H]``;
    shared_down: ``[H, Is]``; shared_expert_gate: ``[1, H]``. With tensor parallelism each rank
    holds a slice of every expert's intermediate dimension and the outputs are summed across ranks;
    the router and the shared-expert gate are replicated. Returns ``[N, H]`` in x.dtype.
    """
    weights, ids = route(x, router_weight, top_k, normalize)
    shared_scale = torch.sigmoid(F.linear(x, shared_expert_gate))
    out = routed_experts(x, weights, ids, experts_gate_up, experts_down)
    return out + shared_scale * swiglu_mlp(x, shared_gate_up, shared_down)
