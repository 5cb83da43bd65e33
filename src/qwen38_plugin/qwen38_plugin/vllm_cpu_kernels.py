"""vLLM's own CPU kernels for the portable model's big products (imports vLLM).

On the CPU platform stock vLLM does not run its linear layers through ``F.linear``: it prepacks
each weight once for oneDNN (`dispatch_cpu_unquantized_gemm`) and runs MoE experts through its
fused grouped GEMM (`cpu_fused_moe`). For the M = 8 decode products of the benchmark's medium
model that is 3x (fp32 lm_head) and 2.5x (routed experts) faster than torch's default GEMM.
`install` hands the same kernels to the portable model: every `Projection` and every layer's
experts (routed and shared, in one fused call). The math is unchanged: tests compare the model
with kernels against transformers (test_qwen38_cpu_kernels and the engine tests).

What is not covered keeps the reference ops, and `install` says which (logged by the caller):
the weights the ops read directly (hyper-connections, PLE, router, shared-expert gate), and fused
experts in a dtype the kernel lacks (it has fp32 and bf16) or with a hidden size it cannot tile.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from vllm import _custom_ops as ops
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

from qwen38_plugin.model import Projection, Qwen4ExpCore, SparseMoe

# cpu_fused_moe tiles its outputs by 32: the hidden size must be a multiple, and the
# intermediate size is zero-padded up to one (zero rows of gate/up and zero columns of down add
# silu(0) * 0 = 0, so the padding is exact), as stock vLLM pads its own MoE layers.
FUSED_MOE_TILE = 32
FUSED_MOE_DTYPES = (torch.float32, torch.bfloat16)

# ``QWEN38_CPU_KERNELS=0`` keeps the reference ops inside vLLM too (for comparison).
SWITCH_ENV = "QWEN38_CPU_KERNELS"


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """The ``QWEN38_CPU_KERNELS`` switch: on unless "0"; anything but "", "0" and "1" is refused."""
    value = (os.environ if environ is None else environ).get(SWITCH_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{SWITCH_ENV}={value!r}: use 1 (vLLM's CPU kernels, the default) or 0 (reference ops)")
    return value != "0"


def install(core: Qwen4ExpCore) -> dict[str, str]:
    """Install the kernels on a loaded model; returns {what: kernel} for the log.

    Call once, after the weights are loaded: the projections' weights move into oneDNN's packed
    layout (the modules keep an empty weight) and the experts' weights into the fused MoE layout.
    """
    used: dict[str, str] = {}
    projections = [m for m in core.modules() if isinstance(m, Projection) and m.kernel is None]
    for module in projections:
        # Stock's own dispatch: oneDNN (or zentorch / sgl where present), or F.linear if oneDNN fails.
        dispatch_cpu_unquantized_gemm(module, remove_weight=True)
        module.use_kernel(_bound_linear(module))
    if projections:
        used["projections"] = f"{len(projections)} through vLLM's CPU GEMM dispatch"
    blocks = [m for m in core.modules() if isinstance(m, SparseMoe) and m.experts_kernel is None]
    if blocks:
        # Every block has the model's dtype and hidden size: one answer holds for all.
        reason = _fused_moe_reason(blocks[0])
        if reason is None:
            isa = _fused_moe_isa(core)
            for block in blocks:
                block.use_experts_kernel(_FusedExperts(block, isa))
            used["experts"] = f"{len(blocks)} layers through vLLM's cpu_fused_moe ({isa})"
        else:
            used["experts (reference)"] = f"{len(blocks)} layers: {reason}"
    return used


def _bound_linear(module: Projection) -> Any:
    # set by dispatch_cpu_unquantized_gemm: (x, weight, bias) -> x @ weight.T + bias
    cpu_linear: Callable[..., torch.Tensor] = getattr(module, "cpu_linear")  # noqa: B009

    def kernel(x: torch.Tensor) -> torch.Tensor:
        # oneDNN reads x as a row-major [M, K] matrix.
        return cpu_linear(x.contiguous(), module.weight, None)

    return kernel


def _fused_moe_reason(block: SparseMoe) -> str | None:
    """Why the fused kernel cannot run this block, or None."""
    gate_up = block.experts.gate_up_proj
    if gate_up.dtype not in FUSED_MOE_DTYPES:
        return f"cpu_fused_moe has no {gate_up.dtype} kernel"
    if gate_up.shape[-1] % FUSED_MOE_TILE:
        return f"hidden_size {gate_up.shape[-1]} is not a multiple of {FUSED_MOE_TILE}"
    return None


def _fused_moe_isa(core: Qwen4ExpCore) -> str:
    # Stock's choice: AMX tiles for bf16 where the CPU has them, the portable vector kernel otherwise.
    bf16 = core.model.embed_tokens.weight.dtype == torch.bfloat16
    return "amx" if bf16 and torch.cpu._is_amx_tile_supported() else "vec"


class _FusedExperts:
    """A `moe.ExpertsKernel` over vLLM's cpu_fused_moe; it owns the packed expert weights.

    The shared expert rides in the same call: its intermediate dimension is cut into pieces of
    the routed experts' (padded) size, appended as extra experts that every token uses with the
    shared gate as weight. A SwiGLU MLP is a sum over its intermediate features, so the pieces'
    sum is the shared expert's output.
    """

    def __init__(self, block: SparseMoe, isa: str) -> None:
        experts = block.experts
        shared = block.shared_expert
        routed_inter = experts.down_proj.shape[-1]
        piece = math.ceil(routed_inter / FUSED_MOE_TILE) * FUSED_MOE_TILE
        routed_gate, routed_up = experts.gate_up_proj.data.chunk(2, dim=1)
        routed_up, routed_down = _as_pieces(routed_gate, routed_up, experts.down_proj.data, piece)
        shared_up, shared_down = _as_pieces(
            shared.gate_proj.weight.data.unsqueeze(0), shared.up_proj.weight.data.unsqueeze(0),
            shared.down_proj.weight.data.unsqueeze(0), piece,
        )  # fmt: skip
        self.num_routed = routed_up.shape[0]
        self.shared_ids = torch.arange(self.num_routed, self.num_routed + shared_up.shape[0], dtype=torch.int32)
        self.isa = isa
        self.w13 = ops.cpu_prepack_moe_weight(torch.cat([routed_up, shared_up]).contiguous(), isa)
        self.w2 = ops.cpu_prepack_moe_weight(torch.cat([routed_down, shared_down]).contiguous(), isa)
        # The block's own copies are no longer read: free them (they stay as empty parameters).
        for param in (experts.gate_up_proj, experts.down_proj, shared.gate_proj.weight, shared.up_proj.weight,
                      shared.down_proj.weight):  # fmt: skip
            param.data = param.data.new_empty(0)

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared_scale: torch.Tensor
    ) -> torch.Tensor:
        tokens = x.shape[0]
        pieces = self.shared_ids.shape[0]
        all_weights = torch.cat([weights.float(), shared_scale.float().expand(tokens, pieces)], dim=1)
        all_ids = torch.cat([ids.to(torch.int32), self.shared_ids.expand(tokens, pieces)], dim=1)
        out = torch.empty_like(x)
        ops.cpu_fused_moe(
            out, x.contiguous(), self.w13, self.w2, None, None, all_weights.contiguous(), all_ids.contiguous(),
            "silu", self.isa,
        )  # fmt: skip
        return out


def _as_pieces(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, piece: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU experts ``gate, up [E, I, H]``, ``down [E, H, I]`` as experts of intermediate size
    ``piece``: (gate_up ``[E * n, 2 * piece, H]``, down ``[E * n, H, piece]``), n = ceil(I / piece).

    The intermediate dimension is zero-padded to n pieces (silu(0) * 0 = 0 through a zero column
    of down: exact) and each expert's n pieces follow each other.
    """
    num, inter, hidden = gate.shape
    n = math.ceil(inter / piece)
    pad = n * piece - inter
    gate, up = F.pad(gate, (0, 0, 0, pad)), F.pad(up, (0, 0, 0, pad))
    down = F.pad(down, (0, pad))
    gate_up = torch.cat([gate.view(num, n, piece, hidden), up.view(num, n, piece, hidden)], dim=2)
    down_pieces = down.view(num, hidden, n, piece).permute(0, 2, 1, 3)
    return gate_up.reshape(num * n, 2 * piece, hidden), down_pieces.reshape(num * n, hidden, piece)
