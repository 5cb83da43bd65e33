"""The QSA Triton kernels (`ops.qsa_paged`, `ops.qsa_step_metadata`) compile for sm_70 and sm_90, anywhere.

`triton.compile` of each kernel as the ops launch it, at Flash-Next's sizes, for a CUDA target:
PTX and a cubin, no GPU needed (shared/docs/sm70-toolchain.md). Each kernel compiles for both
targets: sm_70 gets fp32 FMA index scores and no tensor-core code at all; sm_90 gets tensor cores
for the split-query index scores. The attention kernel's indexed form (one program per token and
KV head; split over programs, with fp32's IEEE dots, on sm_70) compiles for both; its dense form
(no indexer: only a constexpr differs) is left to the interpreter and CUDA tests, since a cold
compile of one attention form takes several seconds of this 2-core machine. Shared memory must
fit the target: 96 KiB on a V100, 227 KiB on Hopper. Prints one ``PASS sm70-fp16/name ...`` /
``FAIL ...`` line per compile; exits non-zero on a failure. test_qwen38_qsa_paged.py runs it in a
subprocess beside the interpreter checks.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qwen38_plugin.ops import qsa_paged, qsa_step_metadata


def _signature(
    kernel: Any, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict[str, Any]
) -> dict[str, str]:
    """Triton's signature of ``kernel``: the given pointer types, fp32 floats, i64 for other ints."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i64"
    return sig


def _compile_cases(
    capability: int, dtype: str
) -> dict[str, tuple[Any, dict[str, str], tuple[str, ...], dict[str, Any], int]]:
    """name: (kernel, pointer types, float args, constexprs, num_warps) as the ops launch them at
    Flash-Next's sizes (D 256, 12 query heads per KV head, Di 128, 16 index heads, budget 2048, ratio 4)."""
    p = f"*{dtype}"
    i32, i64, f32 = "*i32", "*i64", "*fp32"
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    parts = qsa_paged.score_split_parts(torch_dtype, (capability // 10, capability % 10))
    wide = 64 if capability >= 90 else 32  # keys per attention tile where one program walks a whole list
    attention = {
        "q_ptr": p,
        "gate_ptr": p,
        "kv_ptr": p,
        "table_ptr": i32,
        "req_ptr": i32,
        "pos_ptr": i64,
        "selected_ptr": i32,
        "out_ptr": p,
        "partial_acc_ptr": f32,
        "partial_ml_ptr": f32,
    }
    return {
        "write_kv": (qsa_paged._write_kv_kernel, {"kv_ptr": p, "slots_ptr": i64, "k_ptr": p, "v_ptr": p}, (),
                     {"BLOCK_SIZE": 64, "HEAD_DIM": 256, "BLOCK_D": 256}, 4),
        "write_rows": (qsa_paged._write_rows_kernel, {"cache_ptr": p, "slots_ptr": i64, "values_ptr": p}, (),
                       {"ROWS_PER_BLOCK": 16, "FEATURES": 128, "BLOCK_F": 128}, 4),
        "group_keys": (qsa_paged._group_keys_kernel,
                       {"raw_ptr": p, "ring_ptr": p, "ring_block_ptr": i32, "req_ptr": i32, "pos_ptr": i64,
                        "step_start_ptr": i32, "weight_ptr": p, "inv_freq_ptr": f32, "out_ptr": p}, ("eps",),
                       {"RATIO": 4, "CAPACITY": 4, "DIM": 128, "ROTARY_DIM": 64, "BLOCK_D": 128}, 1),
        "index_scores": (qsa_paged._index_scores_kernel,
                         {"q_ptr": f32, "key_ptr": p, "table_ptr": i32, "req_ptr": i32, "complete_ptr": i64,
                          "scores_ptr": f32}, ("score_divisor",),
                         {"TOPK": 512, "NUM_HEADS": 16, "HEAD_DIM": 128, "ROWS_PER_BLOCK": 16,
                          "BLOCK_G": 128 if parts else 64, "BLOCK_H": 16, "BLOCK_D": 128, "SPLIT_PARTS": parts}, 4),
        **{name: (qsa_paged._select_groups_kernel,
                  {"scores_ptr": f32, "complete_ptr": i64, "threshold_ptr": f32, "out_ptr": i32}, (),
                  {"TOPK": 512, "BLOCK": 8192, "BLOCK_K": 512, "GIVEN_THRESHOLD": given}, 8)
           for name, given in (("select_groups", False), ("select_groups_chunked", True))},
        **{f"sparse_attention_{mode}": (
            qsa_paged._sparse_attention_kernel, attention, ("scale_log2",),
            {"RATIO": 4, "TOPK": topk, "HEADS_PER_KV": 12, "NUM_Q_HEADS": 24, "HEAD_DIM": 256, "BLOCK_SIZE": 64,
             "BLOCK_H": 16, "BLOCK_D": 256, "BLOCK_N": block_n, "NUM_SPLITS": splits, "FP32_DOT": dtype == "fp32"}, 4)
           for mode, topk, splits, block_n in (("sparse", 512, 1, wide), ("split", 512, 8, 32))},
        # decode context parallelism 2 at TP 4 (the reference deployment): a rank's partials over its half of
        # the keys for the 12 query heads its DCP group shares one KV head with
        "sparse_attention_dcp": (
            qsa_paged._sparse_attention_kernel, attention, ("scale_log2",),
            {"RATIO": 4, "TOPK": 512, "HEADS_PER_KV": 12, "NUM_Q_HEADS": 12, "HEAD_DIM": 256, "BLOCK_SIZE": 64,
             "BLOCK_H": 16, "BLOCK_D": 256, "BLOCK_N": 32, "NUM_SPLITS": 1, "FP32_DOT": dtype == "fp32",
             "PARTIAL": 1, "DCP_WORLD": 2, "DCP_RANK": 1, "DCP_INTERLEAVE": 1}, 4),
        **{f"step_metadata_{kind.name.lower()}": (
            qsa_step_metadata._step_metadata_kernel,
            {"qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "table_ptr": "*i32", "slot_mapping_ptr": "*i64",
             "token_req_ptr": "*i32", "step_start_ptr": "*i32", "positions_ptr": "*i64", "slots_ptr": "*i64"}, (),
            {"KIND": int(kind), "SEARCH_STEPS": 9, "BLOCK": 256}, 4)
           for kind in qsa_step_metadata.CacheKind},
        # the attention kernel's own 8 splits, and DCP 2's gathered partials (one share a rank)
        **{name: (qsa_paged._merge_splits_kernel,
                  {"partial_acc_ptr": f32, "partial_ml_ptr": f32, "gate_ptr": p, "out_ptr": p}, (),
                  {"HEAD_DIM": 256, "NUM_SPLITS": splits, "BLOCK_S": splits, "BLOCK_D": 256}, 4)
           for name, splits in (("merge_splits", 8), ("merge_dcp", 2))},
    }  # fmt: skip


EVERY_KERNEL = ["write_kv", "write_rows", "group_keys", "index_scores", "select_groups", "sparse_attention_sparse",
                "merge_splits"]  # fmt: skip
# the step-metadata kernel has integer arguments only: one compile per cache kind and target
STEP_METADATA = [f"step_metadata_{kind.name.lower()}" for kind in qsa_step_metadata.CacheKind]
COMPILES = [
    (70, "fp16", [*EVERY_KERNEL, "sparse_attention_dcp", "merge_dcp", *STEP_METADATA]),
    (70, "fp32", ["sparse_attention_split"]),
    (
        90,
        "bf16",
        [
            *EVERY_KERNEL[:4],
            "select_groups_chunked",
            *EVERY_KERNEL[5:],
            "sparse_attention_dcp",
            "merge_dcp",
            *STEP_METADATA,
        ],
    ),
    (90, "fp16", ["index_scores"]),
]
SHARED_LIMIT = {70: 96 << 10, 90: 227 << 10}


def compile_one(capability: int, dtype: str, name: str) -> str:
    kernel, pointers, floats, constexprs, num_warps = _compile_cases(capability, dtype)[name]
    source = ASTSource(fn=kernel, signature=_signature(kernel, pointers, floats, constexprs), constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})
    ptx = compiled.asm["ptx"]
    assert f".target sm_{capability}" in ptx and compiled.asm.get("cubin"), "no PTX for the target or no cubin"
    shared = compiled.metadata.shared
    assert shared <= SHARED_LIMIT[capability], f"{shared} B of shared memory"
    mma = ptx.count("mma")
    if capability == 70:
        assert mma == 0, "tensor-core code for sm_70"  # Triton emits FMA below sm_80
    elif name == "index_scores":
        assert mma, "no tensor-core code for sm_90's index scores"
    return f"{ptx.count(chr(10))} PTX lines, {mma} mma, {shared} B shared"


def main() -> int:
    failed = 0
    for capability, dtype, names in COMPILES:
        for name in names:
            started = time.perf_counter()
            label = f"sm{capability}-{dtype}/{name}"
            try:
                print(f"PASS {label} {compile_one(capability, dtype, name)} ({time.perf_counter() - started:.1f} s)",
                      flush=True)  # fmt: skip
            except Exception as error:  # report every compile, then fail
                failed += 1
                print(f"FAIL {label} {error!r}\n{traceback.format_exc()}", flush=True)
    print(f"compiles={sum(len(n) for _, _, n in COMPILES)} failed={failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
