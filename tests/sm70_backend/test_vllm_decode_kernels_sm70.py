"""vLLM's own Triton kernels on the portable Qwen4Exp's GDN decode path compile for sm_70.

On a GPU the portable model's Gated DeltaNet layers are vLLM's `QwenGatedDeltaNetAttention`, whose
decode steps run two of vLLM 0.32's Triton kernels: the packed fused-recurrent delta rule
(`fused_recurrent_gated_delta_rule_packed_decode_kernel`) and the causal-conv1d state update
(`_causal_conv1d_update_kernel`). They are vLLM's, not ours, but a V100 user runs them, so they are
compiled here for sm_70 (and sm_90) as vLLM launches them at one TP4 rank of Flash-Next's geometry
(16 key heads and 48 value heads of 128 over 4 ranks; the conv over q, k and v: 2,560 channels,
width 4): PTX and a cubin for the target, and no tensor-core code (there is none to lose: both are
elementwise and reductions). The argument lists are vLLM 0.32's; a vLLM that changes them fails
here, naming the kernel, instead of a V100 user's first request.

vLLM's CPU build turns Triton off when no GPU driver is active (`vllm.triton_utils` then hands out
placeholders, and these kernels are plain functions), so the compiles run in a subprocess that
turns it on first (`tests.vllm_triton`). Nothing is launched.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.qwen38_plugin.qsa_paged_compile_check import _signature
from tests.vllm_triton import call_in_subprocess

HEADS_K, HEADS_V, HEAD_DIM, TP = 16, 48, 128, 4
CONV_CHANNELS = (2 * HEADS_K * HEAD_DIM + HEADS_V * HEAD_DIM) // TP


def _packed_decode() -> tuple[Any, dict[str, str], tuple[str, ...], dict[str, Any], int]:
    from vllm.third_party.flash_linear_attention.ops import fused_recurrent

    h, hv = HEADS_K // TP, HEADS_V // TP
    state_row = hv * HEAD_DIM * HEAD_DIM
    pointers = {
        "mixed_qkv": "*fp16",
        "a": "*fp16",
        "b": "*fp16",
        "A_log": "*fp32",
        "dt_bias": "*fp32",
        "o": "*fp16",
        "h0": "*fp32",
        "ht": "*fp32",
        "ssm_state_indices": "*i32",
    }
    constexprs = {
        "stride_mixed_qkv_tok": CONV_CHANNELS,
        "stride_a_tok": hv,
        "stride_b_tok": hv,
        "stride_init_state_token": state_row,
        "stride_final_state_token": state_row,
        "stride_indices_seq": 1,
        "H": h,
        "HV": hv,
        "K": HEAD_DIM,
        "V": HEAD_DIM,
        "BK": HEAD_DIM,
        "BV": 32,
        "SOFTPLUS_THRESHOLD": 20.0,
        "USE_QK_L2NORM_IN_KERNEL": True,
        "SPLIT_BATCH_HEAD_GRID": False,
    }
    return fused_recurrent.fused_recurrent_gated_delta_rule_packed_decode_kernel, pointers, ("scale",), constexprs, 1


def _conv_update() -> tuple[Any, dict[str, str], tuple[str, ...], dict[str, Any], int]:
    from vllm.model_executor.layers.mamba.ops import causal_conv1d

    width, state_len = 4, 3
    pointers = {
        "x_ptr": "*fp16",
        "w_ptr": "*fp16",
        "bias_ptr": "*fp16",
        "conv_state_ptr": "*fp16",
        "conv_state_indices_ptr": "*i32",
        "num_accepted_tokens_ptr": "*i32",
        "query_start_loc_ptr": "*i32",
        "block_idx_last_scheduled_token": "*i32",
        "initial_state_idx": "*i32",
        "o_ptr": "*fp16",
    }
    constexprs = {
        "dim": CONV_CHANNELS,
        "seqlen": 1,
        "state_len": state_len,
        "stride_x_seq": CONV_CHANNELS,
        "stride_x_dim": 1,
        "stride_w_dim": width,
        "stride_w_width": 1,
        "stride_conv_state_seq": CONV_CHANNELS * state_len,
        "stride_conv_state_dim": 1,
        "stride_conv_state_tok": CONV_CHANNELS,
        "stride_state_indices": 1,
        "stride_o_seq": CONV_CHANNELS,
        "stride_o_dim": 1,
        "null_block_id": 0,
        "HAS_BIAS": False,
        "KERNEL_WIDTH": width,
        "SILU_ACTIVATION": True,
        "IS_VARLEN": False,
        "IS_APC_ENABLED": False,
        "IS_SPEC_DECODING": False,
        "NP2_STATELEN": 4,
        "HAS_NULL_BLOCK": True,
        "BLOCK_N": 256,
        "launch_pdl": False,  # programmatic dependent launch is sm_90's; off below it
    }
    return causal_conv1d._causal_conv1d_update_kernel, pointers, (), constexprs, 4


CASES = {"gdn_packed_decode": _packed_decode, "conv1d_update": _conv_update}
TARGETS = (70, 90)


def compile_all() -> dict[str, str]:
    """(in the subprocess) "name-smXX": "PASS ..." or "FAIL ..." for every case and target."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    report = {}
    for name, case in CASES.items():
        for capability in TARGETS:
            label = f"{name}-sm{capability}"
            try:
                kernel, pointers, floats, constexprs, num_warps = case()
                missing = (set(pointers) | set(constexprs)) - set(kernel.arg_names)
                assert not missing, f"{kernel.fn.__name__}: vLLM's arguments changed (no {sorted(missing)})"
                signature = _signature(kernel, pointers, floats, constexprs)
                source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
                options = {"num_warps": num_warps}
                compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
                ptx = compiled.asm["ptx"]
                assert f".target sm_{capability}" in ptx and compiled.asm.get("cubin"), "no PTX or cubin"
                assert "mma" not in ptx, "tensor-core code"  # elementwise and reductions: FMA everywhere
                report[label] = f"PASS {ptx.count(chr(10))} PTX lines"
            except Exception as error:  # report every case
                report[label] = f"FAIL {error!r}"
    return report


@pytest.fixture(scope="module")
def report() -> dict[str, str]:
    pytest.importorskip("triton")
    result: dict[str, str] = call_in_subprocess("tests.sm70_backend.test_vllm_decode_kernels_sm70", "compile_all")
    return result


@pytest.mark.parametrize("capability", TARGETS)
@pytest.mark.parametrize("name", list(CASES))
def test_vllm_gdn_decode_kernel_compiles(report: dict[str, str], name: str, capability: int) -> None:
    line = report[f"{name}-sm{capability}"]
    assert line.startswith("PASS"), line
