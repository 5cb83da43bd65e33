"""The hyper-connection mixer's and the norm + rope op's Triton kernels against their torch
references, and their code generation for sm_70 and sm_90.

Runs under ``TRITON_INTERPRET=1`` on CPU (test_qwen38_fused_ops.py starts it in a subprocess: the
interpreter is chosen when a kernel is decorated) and natively on CUDA. Outputs are compared
with the reference at each step's own inputs (the reference's), so one step's error does not
carry into the next. Prints one ``PASS name ...`` / ``FAIL name ...`` line per check; exits
non-zero on a failure.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from triton_check_runner import run_checks  # this script's folder is first on sys.path

from qwen38_plugin.ops import hyper_connection as hc
from qwen38_plugin.ops import norm_rope, ple_varlen
from qwen38_plugin.ops.common import rotary_cos_sin

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"
NATIVE = DEVICE == "cuda"
GEN = torch.Generator().manual_seed(4321)
# The interpreter's bf16 rounding truncates (see qsa_paged_triton_check.py): bf16 runs natively only.
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if NATIVE else [])]
# Largest error relative to the reference's largest magnitude. The kernels round where the
# reference rounds; what remains is summation order (fp32), and on CUDA cuBLAS's own order in the
# reference's projections, which moves a value by at most a unit or two of the model dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def block_table_column(values: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``values`` as vLLM hands a request's state slot to the PLE ops: column 0 of a ``[R, 2]``
    block table (a strided view; speculative decoding gives each request several slots), ``other``
    in the column beside it, so a kernel that ignores the stride reads the wrong requests' entries."""
    return torch.stack([values, other], dim=1).to(DEVICE)[:, 0]  # sliced on the device: .to() would compact it


def randn(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=GEN) * scale).to(dtype).to(DEVICE)


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.float(), expected.float()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), "non-finite output"
    if not expected.numel():
        return 0.0
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


# (tokens, hidden, hc, rank): decode (1), a small batch, a prefill chunk; hidden and rank not
# powers of two; a rank above 128 (the gate kernel's 16-feature tiles) at a decode and a prefill
# size; the final mixer (no injection) in every shape.
MIXER_SHAPES = [(1, 64, 4, 16), (5, 96, 4, 24), (37, 40, 3, 8), (0, 64, 4, 16), (3, 40, 4, 160), (260, 24, 4, 160)]
if NATIVE:
    MIXER_SHAPES += [(1, 1024, 4, 64), (64, 1024, 4, 64), (300, 2048, 4, 64), (300, 2560, 4, 320)]


def _mixer_inputs(tokens: int, hidden: int, hc_count: int, rank: int, dtype: torch.dtype) -> dict[str, Any]:
    width = hidden * hc_count
    return {
        "streams": randn(tokens, width, dtype=dtype),
        "norm_weight": randn(width, scale=0.1, dtype=dtype),
        "down": randn(rank, width, scale=width**-0.5, dtype=dtype),
        "up": randn(width, rank, scale=rank**-0.5 * 3, dtype=dtype),
        "inject": randn(hc_count, width, scale=width**-0.5, dtype=dtype),
        "block": randn(tokens, hidden, dtype=dtype),
        "injection": (torch.rand(tokens, hc_count, generator=GEN) * 2).to(dtype).to(DEVICE),
    }


def check_hc_norm() -> str:
    worst = 0.0
    cases = 0
    for tokens, hidden, hc_count, rank in MIXER_SHAPES:
        for dtype in DTYPES:
            x = _mixer_inputs(tokens, hidden, hc_count, rank, dtype)
            for fused in (False, True):
                extra = {"block_output": x["block"], "injection": x["injection"]} if fused else {}
                kw = {"hc_count": hc_count, "eps": 1e-6, **extra}
                ref_streams, ref_normed = hc.hc_norm(x["streams"], x["norm_weight"], backend="torch", **kw)
                streams, normed = hc.hc_norm(x["streams"], x["norm_weight"], backend="triton", **kw)
                # the injection is elementwise, rounded as torch rounds (the kernel is compiled
                # without fused multiply-adds): equal bit for bit
                assert torch.equal(streams, ref_streams), "streams after the injection differ"
                assert fused or streams is x["streams"], "without an injection the streams are passed through"
                err = rel(normed, ref_normed)
                assert err <= TOLERANCE[dtype], f"{tokens, hidden, hc_count, dtype, fused}: rel err {err:.2e}"
                worst, cases = max(worst, err), cases + 1
    return f"{cases} cases, worst rel err {worst:.2e}"


def check_hc_mix_normed() -> str:
    worst = 0.0
    cases = 0
    for tokens, hidden, hc_count, rank in MIXER_SHAPES:
        for dtype in DTYPES:
            x = _mixer_inputs(tokens, hidden, hc_count, rank, dtype)
            normed = x["streams"]
            for inject in (x["inject"], None):
                ref = hc.hc_mix_normed(normed, x["down"], x["up"], inject, hc_count=hc_count, backend="torch")
                got = hc.hc_mix_normed(normed, x["down"], x["up"], inject, hc_count=hc_count, backend="triton")
                errs = [rel(got[0], ref[0])]
                if inject is None:
                    assert got[1] is None
                else:
                    assert got[1] is not None and ref[1] is not None
                    errs.append(rel(got[1], ref[1]))
                assert max(errs) <= TOLERANCE[dtype], f"{tokens, hidden, hc_count, rank, dtype}: rel err {errs}"
                worst, cases = max(worst, *errs), cases + 1
    return f"{cases} cases, worst rel err {worst:.2e}"


def check_mixer_end_to_end() -> str:
    """The three kernels in a row against the reference `hc_mix` of `hc_inject`'s streams."""
    worst = 0.0
    for tokens, hidden, hc_count, rank in MIXER_SHAPES:
        for dtype in DTYPES:
            x = _mixer_inputs(tokens, hidden, hc_count, rank, dtype)
            streams = hc.hc_inject(x["streams"], x["block"], x["injection"])
            ref = hc.hc_mix(streams, x["norm_weight"], x["down"], x["up"], x["inject"], hc_count=hc_count, eps=1e-6)
            _, normed = hc.hc_norm(
                x["streams"], x["norm_weight"], hc_count=hc_count, eps=1e-6, block_output=x["block"],
                injection=x["injection"], backend="triton",
            )  # fmt: skip
            got = hc.hc_mix_normed(normed, x["down"], x["up"], x["inject"], hc_count=hc_count, backend="triton")
            assert ref[1] is not None and got[1] is not None
            # rounding differences of the normed streams pass through two projections: twice the step tolerance
            err = max(rel(got[0], ref[0]), rel(got[1], ref[1]))
            assert err <= 2 * TOLERANCE[dtype], f"{tokens, hidden, hc_count, rank, dtype}: rel err {err:.2e}"
            worst = max(worst, err)
    return f"worst rel err {worst:.2e}"


def check_rms_norm_rope() -> str:
    worst = 0.0
    cases = 0
    shapes = [(3, 2, 16, 8), (5, 3, 32, 32), (4, 1, 24, 12), (0, 2, 16, 8)]
    if NATIVE:
        shapes += [(1, 24, 256, 64), (200, 16, 128, 64)]
    for tokens, heads, dim, rotary_dim in shapes:
        for dtype in DTYPES:
            wide = randn(tokens, heads, 2 * dim, dtype=dtype)
            x = wide[..., dim:]  # a strided view, as the queries are of the fused projection
            weight = randn(dim, scale=0.1, dtype=dtype)
            positions = torch.randint(0, 4000, (tokens,), generator=GEN).to(DEVICE)
            cos, sin = rotary_cos_sin(positions, rotary_dim, 1e6, dtype)
            ref = norm_rope.rms_norm_rope(x, weight, cos, sin, 1e-6, backend="torch")
            got = norm_rope.rms_norm_rope(x, weight, cos, sin, 1e-6, backend="triton")
            assert got.is_contiguous() and got.dtype == dtype
            err = rel(got, ref)
            assert err <= TOLERANCE[dtype], f"{tokens, heads, dim, rotary_dim, dtype}: rel err {err:.2e}"
            worst, cases = max(worst, err), cases + 1
    return f"{cases} cases, worst rel err {worst:.2e}"


def check_ple_gated_conv_inputs() -> str:
    """PLE's per-token gate and conv input (`ple_varlen.gated_conv_inputs`)."""
    worst = 0.0
    cases = 0
    shapes = [(1, 64, 4), (6, 48, 3), (0, 64, 4)] + ([(64, 1024, 4), (300, 2048, 4)] if NATIVE else [])
    for tokens, hidden, hc_count in shapes:
        width = hidden * hc_count
        for dtype in DTYPES:
            wide = randn(tokens, 2 * width, dtype=dtype)
            streams = wide[:, :width]  # rows strided past their width, as a view of a wider tensor
            key, value = randn(tokens, width, dtype=dtype), randn(tokens, hidden, dtype=dtype)
            norms = [randn(width, scale=0.1, dtype=dtype) for _ in range(3)]
            kw: dict[str, Any] = {"hc_count": hc_count, "eps": 1e-6, "conv_dtype": dtype}
            ref = ple_varlen.gated_conv_inputs(streams, key, value, *norms, backend="torch", **kw)
            got = ple_varlen.gated_conv_inputs(streams, key, value, *norms, backend="triton", **kw)
            err = max(rel(got[0], ref[0]), rel(got[1], ref[1]))
            assert err <= 2 * TOLERANCE[dtype], f"{tokens, hidden, hc_count, dtype}: rel err {err:.2e}"
            worst, cases = max(worst, err), cases + 1
    return f"{cases} cases, worst rel err {worst:.2e}"


def step_indices(entries: list[Any], trailing: int) -> dict[str, Any]:
    """A step's index tensors (on DEVICE) for entries ``(tokens, slot, continues[, write slots])``
    per request and ``trailing`` padding rows: token_req, query_start_loc, the slots and continue
    flags as strided block-table columns (the spare column holds other requests' values, so a
    stride-blind read takes the wrong ones) and, where the entries name them, the write slots of
    speculative verify rows as a strided ``[R, P]`` view (else None)."""
    counts = torch.tensor([e[0] for e in entries])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    num_tokens = int(counts.sum()) + trailing
    token_req = torch.full((num_tokens,), -1, dtype=torch.int32)
    for r, (n, *_) in enumerate(entries):
        token_req[int(qsl[r]) : int(qsl[r]) + n] = r
    slot_list = [e[1] for e in entries]
    flags = torch.tensor([e[2] for e in entries])
    write_indices = None
    if len(entries[0]) > 3:
        writes = torch.tensor([e[3] for e in entries], dtype=torch.int32)
        spare = torch.full((len(entries), 1), 99, dtype=torch.int32)  # vLLM's spec slots are a block-table slice
        write_indices = torch.cat([writes, spare], dim=1).to(DEVICE)[:, :-1]
    return {
        "num_tokens": num_tokens, "token_req": token_req.to(DEVICE), "qsl": qsl.to(DEVICE),
        "state_indices": block_table_column(torch.tensor(slot_list, dtype=torch.int32),
                                            torch.tensor(slot_list[::-1], dtype=torch.int32)),
        "has_initial": block_table_column(flags, ~flags), "write_indices": write_indices,
    }  # fmt: skip


def check_ple_conv_term() -> str:
    """PLE's conv and state update (`ple_mix_varlen` with ``query_start_loc``: two kernels on
    CUDA) against its torch ops: the term and every slot of the conv-state cache afterwards, over
    steps mixing prefill chunks and decodes, fresh requests (their slots hold NaN garbage, which
    must not leak), a request without a slot and padding rows."""
    hidden, hc_count, kernel, ngram = 16, 4, 4, 3
    width, span, slots = hidden * hc_count, (kernel - 1) * ngram, 9
    worst = 0.0
    cases = 0
    # (tokens, slot, continues) per request, trailing padding rows
    steps = [
        ([(1, 3, True)], 0),
        ([(1, 3, True), (1, 5, True), (1, 0, True)], 2),
        ([(7, 2, False), (1, 4, True), (12, 6, True), (2, -1, True), (0, 7, True)], 3),
        ([(20, 1, False)], 0),
    ]
    for dtype in DTYPES:
        for entries, trailing in steps:
            step = step_indices(entries, trailing)
            num_tokens = step["num_tokens"]
            streams, key = randn(num_tokens, width, dtype=dtype), randn(num_tokens, width, dtype=dtype)
            value = randn(num_tokens, hidden, dtype=dtype)
            norms = [randn(width, scale=0.1, dtype=dtype) for _ in range(3)]
            weight = randn(width, kernel, scale=0.5, dtype=dtype)
            buffer = randn(slots, width * span + 3, dtype=dtype)
            for e in entries:
                if not e[2] and e[1] >= 0:
                    buffer[e[1]] = float("nan")  # a fresh request's slot: garbage
            results = []
            for backend in ("torch", "triton"):
                cache_buffer = buffer.clone()
                cache = cache_buffer[:, 1 : 1 + width * span].view(slots, width, span)  # strided, as vLLM binds it
                term = ple_varlen.ple_mix_varlen(
                    streams, key, value, *norms, weight, cache, step["token_req"], step["qsl"][:-1],
                    step["state_indices"], step["has_initial"], hc_count=hc_count, ngram_size=ngram, eps=1e-6,
                    query_start_loc=step["qsl"], backend=backend,
                )  # fmt: skip
                results.append((term, cache_buffer))
            (ref_term, ref_cache), (term, cache) = results
            assert torch.equal(ref_cache.isnan(), cache.isnan()), "the state slots written differ"
            err = max(rel(term, ref_term), rel(cache.nan_to_num(), ref_cache.nan_to_num()))
            assert err <= 2 * TOLERANCE[dtype], f"{entries}, {dtype}: rel err {err:.2e}"
            worst, cases = max(worst, err), cases + 1
    return f"{cases} cases, worst rel err {worst:.2e}"


def check_ple_ngram_rows() -> str:
    """PLE's n-gram rows and context update (`ngram_rows_varlen` with ``query_start_loc``: two
    kernels on CUDA) against its torch ops: every row and every context slot afterwards, equal
    bit for bit (int64 hashes that wrap), with EOS tokens in the step and in the contexts."""
    ngram, heads_per_ngram, eos, slots = 4, 3, 7, 9
    gen = torch.Generator().manual_seed(17)
    multipliers = torch.randint(-(2**62), 2**62, (ngram,), generator=gen)
    sizes = torch.randint(50, 1000, ((ngram - 1) * heads_per_ngram,), generator=gen)
    offsets = sizes.cumsum(0) - sizes
    cases = 0
    steps = [
        ([(1, 3, True)], 0),
        ([(1, 3, True), (1, 5, True), (1, 0, True)], 2),
        ([(7, 2, False), (1, 4, True), (12, 6, True), (2, -1, True), (0, 7, True)], 3),
        ([(2, 1, True)], 0),
    ]
    for entries, trailing in steps:
        for has_initial_given in (True, False):
            step = step_indices(entries, trailing)
            ids = torch.randint(0, 12, (step["num_tokens"],), generator=gen)  # small ids: EOS (7) comes up often
            buffer = torch.randint(0, 12, (slots, ngram + 2), generator=gen)
            has_initial = step["has_initial"] if has_initial_given else None
            results = []
            for backend in ("torch", "triton"):
                context_buffer = buffer.clone().to(DEVICE)
                context = context_buffer[:, 1:ngram]  # strided, as vLLM binds it
                rows = ple_varlen.ngram_rows_varlen(
                    ids.to(DEVICE), step["token_req"], step["qsl"][:-1], context, step["state_indices"], has_initial,
                    multipliers.to(DEVICE), sizes.to(DEVICE), offsets.to(DEVICE), heads_per_ngram=heads_per_ngram,
                    eos_token_id=eos, query_start_loc=step["qsl"], backend=backend,
                )  # fmt: skip
                results.append((rows, context_buffer))
            (ref_rows, ref_context), (rows, context) = results
            assert torch.equal(rows, ref_rows), f"{entries}: rows differ"
            assert torch.equal(context, ref_context), f"{entries}: contexts differ"
            cases += 1
    return f"{cases} cases equal"


# Speculative verify steps: (tokens, slot read, continues, write slots [P]) per request. The slot
# read from is among its own write slots (vLLM reads the slot of the last kept token), a write slot
# may be -1, a request may have fewer tokens than positions, one has no slot; trailing padding rows.
SPEC_STEPS = [
    ([(4, 3, True, [1, 2, 3, 4])], 0),
    ([(4, 5, True, [5, 6, -1, 8]), (2, 0, True, [7, 0, 2, 3]), (4, -1, True, [1, 3, 4, 6])], 2),
    ([(3, 2, False, [2, 1, 4, 7]), (4, 8, True, [3, 8, 5, 0])], 1),
]


def check_ple_spec_conv_state() -> str:
    """PLE's conv term and state update for speculative verify rows (`ple_mix_varlen` with
    ``write_indices``: on CUDA the term kernel and `_conv_state_kernel` with SPEC) against its torch
    ops: the term and every slot of the cache afterwards, with and without has_initial_state."""
    hidden, hc_count, kernel, ngram, slots = 16, 4, 4, 3, 10
    width, span = hidden * hc_count, (kernel - 1) * ngram
    worst, cases = 0.0, 0
    for dtype in DTYPES:
        for entries, trailing in SPEC_STEPS:
            for has_initial_given in (False, True):
                step = step_indices(entries, trailing)
                n = step["num_tokens"]
                streams, key = randn(n, width, dtype=dtype), randn(n, width, dtype=dtype)
                value = randn(n, hidden, dtype=dtype)
                norms = [randn(width, scale=0.1, dtype=dtype) for _ in range(3)]
                weight = randn(width, kernel, scale=0.5, dtype=dtype)
                buffer = randn(slots, width * span + 3, dtype=dtype)
                has_initial = step["has_initial"] if has_initial_given else None
                results = []
                for backend in ("torch", "triton"):
                    cache_buffer = buffer.clone()
                    cache = cache_buffer[:, 1 : 1 + width * span].view(slots, width, span)
                    term = ple_varlen.ple_mix_varlen(
                        streams, key, value, *norms, weight, cache, step["token_req"], step["qsl"][:-1],
                        step["state_indices"], has_initial, hc_count=hc_count, ngram_size=ngram, eps=1e-6,
                        write_indices=step["write_indices"], query_start_loc=step["qsl"], backend=backend,
                    )  # fmt: skip
                    results.append((term, cache_buffer))
                (ref_term, ref_cache), (term, cache) = results
                assert not torch.equal(ref_cache, buffer), f"{entries}: the reference wrote no slot"
                err = max(rel(term, ref_term), rel(cache, ref_cache))
                assert err <= 2 * TOLERANCE[dtype], f"{entries}, {dtype}, {has_initial_given}: rel err {err:.2e}"
                worst, cases = max(worst, err), cases + 1
    return f"{cases} cases, worst rel err {worst:.2e}"


def check_ple_spec_ngram_context() -> str:
    """PLE's n-gram rows and context update for speculative verify rows (`ngram_rows_varlen` with
    ``write_indices``: on CUDA the rows kernel and `_ngram_context_kernel` with SPEC) against its torch
    ops, bit for bit: every row and every context slot afterwards."""
    ngram, heads_per_ngram, eos, slots = 4, 3, 7, 10
    gen = torch.Generator().manual_seed(23)
    multipliers = torch.randint(-(2**62), 2**62, (ngram,), generator=gen).to(DEVICE)
    sizes = torch.randint(50, 1000, ((ngram - 1) * heads_per_ngram,), generator=gen)
    offsets = (sizes.cumsum(0) - sizes).to(DEVICE)
    cases = 0
    for entries, trailing in SPEC_STEPS:
        for has_initial_given in (False, True):
            step = step_indices(entries, trailing)
            ids = torch.randint(0, 12, (step["num_tokens"],), generator=gen).to(DEVICE)  # EOS (7) comes up often
            buffer = torch.randint(0, 12, (slots, ngram + 2), generator=gen).to(DEVICE)
            results = []
            for backend in ("torch", "triton"):
                context_buffer = buffer.clone()
                rows = ple_varlen.ngram_rows_varlen(
                    ids, step["token_req"], step["qsl"][:-1], context_buffer[:, 1:ngram], step["state_indices"],
                    step["has_initial"] if has_initial_given else None, multipliers, sizes.to(DEVICE), offsets,
                    heads_per_ngram=heads_per_ngram, eos_token_id=eos, write_indices=step["write_indices"],
                    query_start_loc=step["qsl"], backend=backend,
                )  # fmt: skip
                results.append((rows, context_buffer))
            (ref_rows, ref_context), (rows, context) = results
            assert not torch.equal(ref_context, buffer), f"{entries}: the reference wrote no slot"
            assert torch.equal(rows, ref_rows), f"{entries}: rows differ"
            assert torch.equal(context, ref_context), f"{entries}, {has_initial_given}: contexts differ"
            cases += 1
    return f"{cases} cases equal"


def check_imports_without_vllm() -> str:
    assert "vllm" not in sys.modules, "importing the ops imported vllm"
    return "no vllm in sys.modules"


CHECKS: dict[str, Callable[[], str]] = {
    "hc_norm": check_hc_norm,
    "hc_mix_normed": check_hc_mix_normed,
    "hc_mixer_end_to_end": check_mixer_end_to_end,
    "rms_norm_rope": check_rms_norm_rope,
    "ple_gated_conv_inputs": check_ple_gated_conv_inputs,
    "ple_conv_term": check_ple_conv_term,
    "ple_ngram_rows": check_ple_ngram_rows,
    "ple_spec_conv_state": check_ple_spec_conv_state,
    "ple_spec_ngram_context": check_ple_spec_ngram_context,
    "imports_without_vllm": check_imports_without_vllm,
}


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS, DEVICE))
