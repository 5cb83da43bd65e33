"""AWQ W4A16 ops: one dispatcher by device.

CUDA tensors run the NVRTC-compiled kernels of ``awq_w4a16.cu`` (compiled for the device's own
architecture: sm_70 on a V100): ``sm70_awq_gemv`` for at most `GEMV_MAX_M` rows (decode), else the
tensor-core ``sm70_awq_gemm``; the MoE op runs ``sm70_awq_gemm`` over expert-sorted row blocks.
Any other device runs the plain-torch reference (``awq_reference``). This module imports neither
vLLM nor a GPU.

``check_config`` / ``check_shape`` are the startup checks: anything the kernels cannot run raises
``ValueError`` naming the supported set, so nothing fails at request time.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from sm70_backend.kernels import awq_reference
from sm70_backend.kernels.nvrtc import compile_cached, kernel_source

SOURCE_NAME = "awq_w4a16.cu"
SUPPORTED_BITS = (4,)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
SUPPORTED_DTYPES = (torch.float16,)
PACK = 8  # 4-bit values per int32 word
GEMV_MAX_M = 8
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32  # sm70_awq_gemm's tile
GEMV_WORDS_PER_CTA = 32
MAX_SPLITS = 16


def check_config(bits: int, group_size: int, zero_point: bool, dtype: torch.dtype | None = None) -> None:
    """Raise ValueError naming the supported set for a quantization config the kernels cannot run."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"SM70 AWQ: {bits}-bit weights are not supported; supported: bits {SUPPORTED_BITS}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"SM70 AWQ: group size {group_size} is not supported; supported: group sizes {SUPPORTED_GROUP_SIZES}"
        )
    if not zero_point:
        raise ValueError("SM70 AWQ: zero_point false (symmetric AWQ) is not supported; supported: zero_point true")
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"SM70 AWQ: activation dtype {dtype} is not supported; supported: torch.float16 (a V100 has no bf16: "
            f"run with --dtype float16)"
        )


def check_shape(input_size: int, output_size: int, group_size: int, what: str = "layer") -> None:
    """Raise ValueError unless ``[input_size, output_size]`` (per rank) can be served."""
    if input_size % group_size:
        raise ValueError(
            f"SM70 AWQ: {what} has input size {input_size} per rank, not a multiple of the group size {group_size}; "
            f"supported: input sizes divisible by the group size (lower --tensor-parallel-size)"
        )
    if output_size % PACK:
        raise ValueError(
            f"SM70 AWQ: {what} has output size {output_size} per rank, not a multiple of {PACK}; supported: output "
            f"sizes divisible by {PACK} (lower --tensor-parallel-size)"
        )


@functools.cache
def kernels_for(device_index: int) -> tuple[object, object, object]:
    from sm70_backend.kernels.driver import Module

    device = torch.device("cuda", device_index)
    major, minor = torch.cuda.get_device_capability(device)
    compiled = compile_cached(kernel_source(SOURCE_NAME), major * 10 + minor, {}, SOURCE_NAME)
    module = Module(compiled.cubin, device)
    return module.kernel("sm70_awq_gemv"), module.kernel("sm70_awq_reduce"), module.kernel("sm70_awq_gemm")


def prepare(device: torch.device) -> None:
    """Compile and load the kernels now (startup), not at the first request."""
    if device.type == "cuda":
        kernels_for(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def choose_splits(n: int, k: int, group_size: int, num_sms: int) -> int:
    """K splits of the decode kernel: enough CTAs for two waves of the SMs, whole groups per split."""
    ctas = -(-(n // PACK) // GEMV_WORDS_PER_CTA)
    groups = k // group_size
    return max(1, min(MAX_SPLITS, groups, -(-2 * num_sms // ctas)))


def _check_operands(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    for name, t in (("x", x), ("out", out)):
        if t.dtype != torch.float16 or t.stride(-1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
            raise ValueError(f"SM70 AWQ: {name} must be fp16 with a contiguous last dimension and 16-byte aligned rows")
    if not (qweight.is_contiguous() and scales.is_contiguous()):
        raise ValueError("SM70 AWQ: qweight, qzeros and scales must be contiguous")


def _i64(v: int) -> ctypes.c_int64:
    return ctypes.c_int64(v)


def _i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(v)


def awq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    force_gemm: bool = False,
) -> torch.Tensor:
    """``x [M, K] @ W`` (``W`` from AWQ's ``qweight [K, N/8]``, ``qzeros``, ``scales [K/G, N]``), fp16 out."""
    m, k = x.shape
    n = qweight.shape[1] * PACK
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if x.device.type != "cuda":
        out.copy_(awq_reference.awq_matmul(x, qweight, qzeros, scales))
        return out
    from sm70_backend.kernels.driver import pointer

    if m == 0:
        return out
    _check_operands(x, qweight, scales, out)
    group_size = k // scales.shape[0]
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    gemv, reduce, gemm = kernels_for(index)
    stream = int(torch.cuda.current_stream(x.device).cuda_stream)
    if m <= GEMV_MAX_M and not force_gemm:
        splits = choose_splits(n, k, group_size, _num_sms(index))
        groups_per_split = -(-(k // group_size) // splits)
        splits = -(-(k // group_size) // groups_per_split)
        partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else None
        gemv.launch(  # type: ignore[attr-defined]
            (-(-(n // PACK) // GEMV_WORDS_PER_CTA), splits, 1),
            (128, 1, 1),
            0,
            [
                pointer(x), _i64(x.stride(0)), pointer(qweight), pointer(qzeros), pointer(scales),
                pointer(out), _i64(out.stride(0)), pointer(partial),
                _i32(m), _i32(k), _i32(n), _i32(group_size), _i32(groups_per_split * group_size),
            ],
            stream,
        )  # fmt: skip
        if partial is not None:
            reduce.launch(  # type: ignore[attr-defined]
                (-(-(m * n) // 256), 1, 1),
                (256, 1, 1),
                0,
                [pointer(partial), _i32(splits), _i32(m), _i32(n), pointer(out), _i64(out.stride(0))],
                stream,
            )
        return out
    gemm.launch(  # type: ignore[attr-defined]
        (-(-n // BLOCK_N), -(-m // BLOCK_M), 1),
        (128, 1, 1),
        0,
        [
            pointer(x), _i64(x.stride(0)), pointer(qweight), pointer(qzeros), pointer(scales),
            _i64(0), _i64(0), _i64(0), pointer(out), _i64(out.stride(0)),
            _i32(m), _i32(k), _i32(n), _i32(group_size), pointer(None), pointer(None), _i32(1), _i32(0),
        ],
        stream,
    )  # fmt: skip
    return out


@torch.library.custom_op("sm70_backend::awq_linear", mutates_args=())
def awq_linear_op(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`awq_linear` as a torch custom op: torch.compile (vLLM's default on CUDA) sees one opaque call
    with a known output shape instead of tracing the launch code (raw pointers, alignment checks)."""
    return awq_linear(x, qweight, qzeros, scales)


@awq_linear_op.register_fake
def _awq_linear_shape(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[1] * PACK)


@dataclass(frozen=True)
class AwqExperts:
    """Stacked AWQ expert weights: ``qweight [E, K, N/8]``, ``qzeros [E, K/G, N/8]``, ``scales [E, K/G, N]``."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor

    def as_tuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qweight, self.qzeros, self.scales


def _moe_gemm(
    x: torch.Tensor,
    w: AwqExperts,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    a_row_div: int,
    num_valid: int,
) -> None:
    from sm70_backend.kernels.driver import pointer

    _check_operands(x, w.qweight, w.scales, out)
    k = x.shape[1]
    n = w.qweight.shape[2] * PACK
    group_size = k // w.scales.shape[1]
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    gemm = kernels_for(index)[2]
    gemm.launch(  # type: ignore[attr-defined]
        (-(-n // BLOCK_N), expert_ids.shape[0], 1),
        (128, 1, 1),
        0,
        [
            pointer(x), _i64(x.stride(0)), pointer(w.qweight), pointer(w.qzeros), pointer(w.scales),
            _i64(w.qweight.stride(0)), _i64(w.qzeros.stride(0)), _i64(w.scales.stride(0)),
            pointer(out), _i64(out.stride(0)),
            _i32(0), _i32(k), _i32(n), _i32(group_size), pointer(sorted_ids), pointer(expert_ids),
            _i32(a_row_div), _i32(num_valid),
        ],
        int(torch.cuda.current_stream(x.device).cuda_stream),
    )  # fmt: skip


def awq_moe(
    x: torch.Tensor,
    w13: AwqExperts,
    w2: AwqExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """SiLU-gated MoE over AWQ experts (``w13``: gate then up columns). ``x [T, H]`` fp16 -> ``[T, H]``.

    On CUDA: rows sorted by expert (`awq_reference.align_block_size`, the format of vLLM's
    ``moe_align_block_size``, shapes fixed by ``T`` so CUDA graphs can capture it), one
    ``sm70_awq_gemm`` for gate/up over the token rows, SiLU-and-mul in fp32, one for down over
    the (token, slot) rows, then the router-weighted sum over slots in fp32."""
    if x.device.type != "cuda":
        return awq_reference.moe_reference(
            x, w13.as_tuple(), w2.as_tuple(), topk_weights, topk_ids, apply_router_weight_on_input
        )
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.qweight.shape[0]
    inter2 = w13.qweight.shape[2] * PACK
    hidden = w2.qweight.shape[2] * PACK
    sorted_ids, expert_ids, _ = awq_reference.align_block_size(topk_ids, num_experts, BLOCK_M)
    weights = topk_weights.to(torch.float32)
    if apply_router_weight_on_input:
        if top_k != 1:
            raise ValueError("SM70 AWQ MoE: apply_router_weight_on_input needs top_k 1")
        x = (x.to(torch.float32) * weights).to(x.dtype)
    gate_up = torch.zeros(num_tokens * top_k, inter2, dtype=x.dtype, device=x.device)
    _moe_gemm(x.contiguous(), w13, gate_up, sorted_ids, expert_ids, top_k, num_tokens * top_k)
    half = inter2 // 2
    act = (torch.nn.functional.silu(gate_up[:, :half].float()) * gate_up[:, half:].float()).to(x.dtype)
    down = torch.zeros(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _moe_gemm(act, w2, down, sorted_ids, expert_ids, 1, num_tokens * top_k)
    down32 = down.view(num_tokens, top_k, hidden).to(torch.float32)
    if not apply_router_weight_on_input:
        down32 = down32 * weights.unsqueeze(-1)
    return down32.sum(1).to(x.dtype)
