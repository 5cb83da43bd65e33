"""The served model's fused ops: the hyper-connection mixer in two steps (`hyper_connection.hc_norm`,
`hc_mix_normed`: three kernels), PLE's gate and conv (`ple_varlen.gated_conv_inputs`, the conv and
state update of `ple_mix_varlen`) and per-head RMSNorm + partial RoPE (`norm_rope.rms_norm_rope`).

- their torch paths (CPU) compose to exactly the reference mixer and injection;
- the Triton kernels match the torch paths (fused_ops_triton_check.py, in a subprocess: under
  ``TRITON_INTERPRET=1`` on CPU, natively on CUDA);
- the kernels compile for sm_70 (V100: FMA, no tensor-core code) and sm_90;
- on CUDA, a mixer captured in a CUDA graph replays the eager result bit for bit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from qwen38_plugin.ops import hyper_connection as hc
from qwen38_plugin.ops import norm_rope, ple_varlen
from tests.qwen38_plugin.qsa_paged_compile_check import _signature

HERE = Path(__file__).resolve().parent
HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_steps_with_a_pending_injection_equal_the_reference_mixer(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, hc_count, rank = 6, 48, 4, 16
    width = hidden * hc_count
    streams = torch.randn(tokens, width, generator=gen).to(dtype)
    norm_weight = (torch.randn(width, generator=gen) * 0.1).to(dtype)
    down = (torch.randn(rank, width, generator=gen) * 0.1).to(dtype)
    up = (torch.randn(width, rank, generator=gen) * 0.3).to(dtype)
    inject = (torch.randn(hc_count, width, generator=gen) * 0.1).to(dtype)
    block = torch.randn(tokens, hidden, generator=gen).to(dtype)
    injection = torch.rand(tokens, hc_count, generator=gen).to(dtype)
    expected_streams = hc.hc_inject(streams, block, injection)
    for weight in (inject, None):
        expected = hc.hc_mix(expected_streams, norm_weight, down, up, weight, hc_count=hc_count, eps=1e-6)
        got_streams, normed = hc.hc_norm(
            streams, norm_weight, hc_count=hc_count, eps=1e-6, block_output=block, injection=injection
        )
        mixed, weights = hc.hc_mix_normed(normed, down, up, weight, hc_count=hc_count)
        assert torch.equal(got_streams, expected_streams)
        assert torch.equal(mixed, expected[0])
        assert (weights is None and expected[1] is None) or torch.equal(weights, expected[1])  # type: ignore[arg-type]


def test_bad_arguments_are_refused() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="block_output and injection come together"):
        hc.hc_norm(x, torch.zeros(8), hc_count=2, eps=1e-6, block_output=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="backend must be one of"):
        hc.hc_mix_normed(x, torch.zeros(4, 8), torch.zeros(8, 4), None, hc_count=2, backend="cuda")


def test_dispatch_picks_triton_for_cuda_only_and_obeys_the_reference_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2, 8)
    assert not hc.use_triton(x) and hc.use_triton(x, "triton") and not hc.use_triton(x, "torch")
    if HAS_CUDA and hc.HAVE_TRITON:
        y = x.cuda()
        assert hc.use_triton(y)
        monkeypatch.setenv(hc.REFERENCE_ENV, "1")
        assert not hc.use_triton(y)
    # the norm + rope op's own switch: on CPU the reference is the composition, bit for bit
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 16, generator=gen)
    weight, cos, sin = (
        torch.randn(16, generator=gen),
        torch.randn(3, 8, generator=gen),
        torch.randn(3, 8, generator=gen),
    )
    assert torch.equal(
        norm_rope.rms_norm_rope(q, weight, cos, sin, 1e-6), norm_rope.rms_norm_rope_torch(q, weight, cos, sin, 1e-6)
    )


@pytest.fixture(scope="module")
def kernel_report() -> dict[str, str]:
    env = {**os.environ, **({} if HAS_CUDA else {"TRITON_INTERPRET": "1"})}
    proc = subprocess.run(
        [sys.executable, str(HERE / "fused_ops_triton_check.py")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    report = {m.group(2): m.group(0) for m in re.finditer(r"^(PASS|FAIL) (\S+).*$", log, re.MULTILINE)}
    report["__log__"] = log
    return report


@pytest.mark.parametrize(
    "check",
    [
        "hc_norm",
        "hc_mix_normed",
        "hc_mixer_end_to_end",
        "rms_norm_rope",
        "ple_gated_conv_inputs",
        "ple_conv_term",
        "ple_ngram_rows",
        "ple_spec_conv_state",
        "ple_spec_ngram_context",
        "imports_without_vllm",
    ],
)
def test_triton_kernels_match_torch(kernel_report: dict[str, str], check: str) -> None:
    line = kernel_report.get(check)
    assert line is not None, f"check {check} did not report:\n{kernel_report['__log__'][-4000:]}"
    assert line.startswith("PASS"), line


def _cases(dtype: str) -> dict[str, tuple[Any, dict[str, str], tuple[str, ...], dict[str, Any]]]:
    """name: (kernel, pointer types, float args, constexprs) at Flash-Next's sizes (hidden 2048 ->
    hc 4 streams of 2048, rank 64; 24 query heads of 256 with 64 rotary features)."""
    p = f"*{dtype}"
    return {
        "hc_norm": (hc._hc_norm_kernel, dict.fromkeys(["streams_ptr", "block_ptr", "injection_ptr", "weight_ptr",
                                                         "out_ptr", "normed_ptr"], p), ("eps",),
                    {"INJECT": True, "HC": 4, "BLOCK_H": 2048}),
        "hc_project": (hc._hc_project_kernel, {**dict.fromkeys(["normed_ptr", "down_w_ptr", "inject_w_ptr"], p),
                                                "partials_ptr": "*fp32"}, (),
                       {"BLOCK_T": 16, "BLOCK_N": 16, "BLOCK_K": 128, "FP32_DOT": False}),
        "hc_gate_mix": (hc._hc_gate_mix_kernel, {**dict.fromkeys(["normed_ptr", "up_w_ptr", "mixed_ptr",
                                                                   "injection_ptr"], p), "partials_ptr": "*fp32"}, (),
                        {"INJECT": True, "HC": 4, "SPLITS": 16, "GROUP_S": hc.gate_split_group(16, 16, 64),
                         "BLOCK_T": 16, "BLOCK_H": 32, "BLOCK_R": 64, "BLOCK_HC": 4, "FP32_DOT": False}),
        "ple_gated_conv_inputs": (ple_varlen._gated_conv_inputs_kernel,
                                  dict.fromkeys(["streams_ptr", "key_ptr", "value_ptr", "norm_key_ptr",
                                                 "norm_query_ptr", "norm_conv_ptr", "gated_ptr", "conv_ptr"], p),
                                  ("eps", "inv_sqrt_hidden"), {"BLOCK_H": 2048}),
        "ple_conv_term": (ple_varlen._conv_term_kernel,
                          {**dict.fromkeys(["gated_ptr", "conv_in_ptr", "weight_ptr", "state_ptr", "term_ptr"], p),
                           "token_req_ptr": "*i32", "qsl_ptr": "*i32", "state_indices_ptr": "*i32",
                           "continues_ptr": "*i1"}, (), {"KERNEL": 4, "HAS_INITIAL": True, "BLOCK_C": 128}),
        **{f"ple_conv_state{'_spec' if spec else ''}": (
            ple_varlen._conv_state_kernel,
            {**dict.fromkeys(["conv_in_ptr", "state_ptr"], p), "qsl_ptr": "*i32", "state_indices_ptr": "*i32",
             "continues_ptr": "*i1", "write_ptr": "*i32"}, (),
            {"HAS_INITIAL": not spec, "SPEC": spec, "BLOCK_C": 32 if spec else 128, "BLOCK_S": 16,
             "BLOCK_P": 4 if spec else 1}) for spec in (False, True)},
        "ple_ngram_rows": (ple_varlen._ngram_rows_kernel,
                           {"ids_ptr": "*i64", "token_req_ptr": "*i32", "qsl_ptr": "*i32", "context_ptr": "*i64",
                            "state_indices_ptr": "*i32", "continues_ptr": "*i1", "multipliers_ptr": "*i64",
                            "sizes_ptr": "*i64", "offsets_ptr": "*i64", "rows_ptr": "*i64"}, (),
                           {"NGRAM": 4, "HEADS_PER_NGRAM": 8, "HAS_INITIAL": True, "BLOCK_HEADS": 8}),
        **{f"ple_ngram_context{'_spec' if spec else ''}": (
            ple_varlen._ngram_context_kernel,
            {"ids_ptr": "*i64", "qsl_ptr": "*i32", "context_ptr": "*i64", "state_indices_ptr": "*i32",
             "continues_ptr": "*i1", "write_ptr": "*i32"}, (),
            {"CONTEXT": 3, "HAS_INITIAL": not spec, "SPEC": spec, "BLOCK": 4, "BLOCK_P": 4 if spec else 1})
            for spec in (False, True)},
        "rms_norm_rope": (norm_rope._rms_norm_rope_kernel, dict.fromkeys(["x_ptr", "weight_ptr", "cos_ptr", "sin_ptr",
                                                                          "out_ptr"], p), ("eps",),
                          {"BLOCK_D": 256}),
    }  # fmt: skip


@pytest.mark.skipif(not hc.HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize(("capability", "dtype"), [(70, "fp16"), (90, "bf16")])
def test_kernels_compile_for_sm70_and_sm90(capability: int, dtype: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name, (kernel, pointers, floats, constexprs) in _cases(dtype).items():
        source = ASTSource(fn=kernel, signature=_signature(kernel, pointers, floats, constexprs), constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
        ptx = compiled.asm["ptx"]
        assert f".target sm_{capability}" in ptx and compiled.asm.get("cubin"), name
        if capability == 70:
            assert "mma" not in ptx, f"{name}: tensor-core code for sm_70"  # Triton emits FMA below sm_80
        elif name in ("hc_project", "hc_gate_mix"):
            assert "mma" in ptx, f"{name}: no tensor-core code on sm_90"


def _gate_mix_sass(splits: int, block_r: int, tokens: int = 16) -> str:
    """sm_90 SASS of the gate kernel as a fp16 step of ``tokens`` rows launches it (its tiles and warps
    as `hc_mix_normed` picks them), pointers 16-byte aligned and the row strides divisible by 16, as
    the launch specializes them."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = hc._hc_gate_mix_kernel
    pointers = {**dict.fromkeys(["normed_ptr", "up_w_ptr", "mixed_ptr", "injection_ptr"], "*fp16"),
                "partials_ptr": "*fp32"}  # fmt: skip
    block_t, block_h, num_warps = hc.gate_tiles(tokens, block_r)
    group = hc.gate_split_group(splits, block_t, block_r)
    constexprs = {"INJECT": True, "HC": 4, "SPLITS": splits, "GROUP_S": group, "BLOCK_T": block_t,
                  "BLOCK_H": block_h, "BLOCK_R": block_r, "BLOCK_HC": 4, "FP32_DOT": False}  # fmt: skip
    signature = _signature(kernel, pointers, (), constexprs)
    aligned = {*pointers, "stride_normed", "stride_up_w", "stride_mixed"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        pytest.skip(f"{nvdisasm} is not in this Triton")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(nvdisasm), "-c", cubin.name], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(not hc.HAVE_TRITON, reason="needs triton")
def test_gate_kernel_loads_the_partials_together_and_does_not_spill() -> None:
    # Summed one split at a time, each split's tile crossed shared memory on its own, so a decode
    # step waited for memory 16 times in a row (8 loads before the first barrier, 49 barriers), and
    # at Flash-Next's rank 320 the kernel spilled 6,673 loads to local memory; grouped loads (and
    # smaller tiles and more warps for a large rank) fix both.
    decode = _gate_mix_sass(16, 64)  # the medium config's decode step: 16 K splits of 4 * 1024
    before_barrier = decode.split("BAR.SYNC", 1)[0]
    assert before_barrier.count("LDG.E ") >= 64, "the first split group's partial loads are not issued together"
    assert decode.count("BAR.SYNC") <= 24, f"{decode.count('BAR.SYNC')} barriers"
    assert "LDL" not in decode and "STL" not in decode, "the gate kernel spills to local memory"
    flash_next = _gate_mix_sass(7, 512)  # hidden 2560 * 4 streams, rank 320 (2026-12-03: 3 spill loads)
    assert flash_next.count("LDL") <= 8, f"{flash_next.count('LDL')} loads from local memory (spills)"


@pytest.mark.skipif(not hc.HAVE_TRITON, reason="needs triton")
def test_gate_kernel_does_not_spill_at_prefill_sizes() -> None:
    # A prefill chunk's step (above 256 tokens, one K split) takes 32-token tiles; at Flash-Next's
    # rank 320 the 64-feature tiles of the medium config spilled 714 loads a program.
    medium = _gate_mix_sass(1, 64, tokens=2048)
    assert "LDL" not in medium and "STL" not in medium, "the gate kernel spills to local memory"
    flash_next = _gate_mix_sass(1, 512, tokens=2048)
    assert flash_next.count("LDL") <= 8, f"{flash_next.count('LDL')} loads from local memory (spills)"


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (CUDA graphs); none here")
def test_mixer_replayed_from_a_cuda_graph_equals_eager() -> None:
    gen = torch.Generator().manual_seed(5)
    tokens, hidden, hc_count, rank = 8, 1024, 4, 64
    width = hidden * hc_count

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).half().cuda()

    streams, block = rand(tokens, width), rand(tokens, hidden)
    injection = torch.rand(tokens, hc_count, generator=gen).half().cuda()
    weights = (
        rand(width, scale=0.1),
        rand(rank, width, scale=0.02),
        rand(width, rank, scale=0.3),
        rand(hc_count, width),
    )

    def mixer() -> tuple[torch.Tensor, ...]:
        out, normed = hc.hc_norm(
            streams, weights[0], hc_count=hc_count, eps=1e-6, block_output=block, injection=injection
        )
        mixed, inj = hc.hc_mix_normed(normed, weights[1], weights[2], weights[3], hc_count=hc_count)
        assert inj is not None
        return out, mixed, inj

    eager = mixer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mixer()
    for t in captured:
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager, strict=True):
        assert torch.equal(a, b)
