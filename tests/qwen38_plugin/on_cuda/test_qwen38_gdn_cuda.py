"""Gated DeltaNet through flash-linear-attention's kernels (fla-core) on CUDA, against the plain-torch reference.

Runs everywhere; the CUDA parts skip, saying why, on machines without a CUDA device or without
fla-core (the plugin's ``[cuda]`` extra). On a CUDA machine:

    python -m pytest --noconftest tests/qwen38_plugin/on_cuda -q -rA

(``--noconftest``: the repository's conftest starts vLLM servers, which a bare GPU box lacks.)
The last run's output is in benchmarks/qwen38_plugin/results/gdn_cuda_checks.txt.

Error measure: max |actual - expected| / max |expected| (`rel`), each check on fresh random
inputs. Tolerances, per dtype of the inputs:
- the delta rule alone (fla vs the plain-torch reference computed in fp32 on the same, rounded
  inputs): fp32 5e-3 (fla's fp32 dots may use TF32), fp16 1e-2, bf16 3e-2 (fla keeps some
  intermediates in the input dtype);
- the whole tiny model on CUDA with fla's GDN, per dtype, against (a) the fp32 reference (the
  same model in fp32 on CUDA with the plain-torch ops): last-position logits within 5e-3 (fp32:
  fla's dots may run in TF32), 1e-2 (fp16), 5e-2 (bf16); and (b) the same model and dtype with
  the plain-torch GDN (only the kernel differs): within 5e-3, 1e-2, 5e-2 (the half-precision
  bounds of the transformers comparisons in test_qwen38_model.py). fp32 greedy tokens equal the
  reference's over 32 steps; in fp16/bf16 the prefill's argmax must agree, and how many of the
  32 greedy tokens agree (after a near-tie they may part) is printed, not asserted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qwen38_plugin.ops import gdn, gdn_cuda

HAS_CUDA = torch.cuda.is_available()
HAS_FLA = gdn_cuda.fla_kernels() is not None
needs_cuda_and_fla = pytest.mark.skipif(
    not (HAS_CUDA and HAS_FLA),
    reason=(
        f"needs a CUDA device (found: {HAS_CUDA}) and fla-core (installed: {HAS_FLA}); "
        "run on a GPU machine with `pip install 'vllm-qwen38-plugin[cuda]'`"
    ),
)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
RULE_TOL = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
MODEL_TOL = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
REF_TOL = MODEL_TOL


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert torch.isfinite(actual).all(), "non-finite output"
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def layer_inputs(
    batch: int, seq_len: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, device: str, seed: int
) -> dict[str, Any]:
    """Random inputs of one GDN layer (between its projections), states included."""
    gen = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    return {
        "mixed_qkv": r(batch, seq_len, conv_dim),
        "z": r(batch, seq_len, hv * dv),
        "a": r(batch, seq_len, hv),
        "b": r(batch, seq_len, hv),
        "conv_weight": r(conv_dim, 4, scale=0.5),
        "a_log": r(hv, scale=0.5),
        "dt_bias": r(hv, scale=0.5),
        "norm_weight": r(dv),
        "conv_state": r(batch, conv_dim, 3),
        "recurrent_state": (torch.randn(batch, hv, dk, dv, generator=gen) * 0.1).to(device),
        "num_k_heads": hk,
        "head_k_dim": dk,
        "head_v_dim": dv,
        "eps": 1e-6,
    }


# -- everywhere -------------------------------------------------------------------------------


def test_cpu_tensors_take_the_plain_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    args = layer_inputs(2, 5, 2, 6, 16, 16, torch.float32, "cpu", seed=0)
    monkeypatch.delenv(gdn.KERNELS_ENV, raising=False)
    auto = gdn.gated_delta_net(**args)
    reference = gdn.gated_delta_net(**args, kernels="torch")
    for a, b in zip(auto, reference, strict=True):
        assert torch.equal(a, b)
    with pytest.raises((RuntimeError, ValueError), match=r"fla-core|CUDA tensors"):
        gdn.gated_delta_net(**args, kernels="fla")
    with pytest.raises(ValueError, match="kernels='triton'; use one of auto, torch, fla"):
        gdn.gated_delta_net(**args, kernels="triton")
    monkeypatch.setenv(gdn.KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="QWEN38_GDN_KERNELS='cuda': use one of auto, torch, fla"):
        gdn.gated_delta_net(**args)


# -- CUDA -------------------------------------------------------------------------------------


def rule_inputs(
    batch: int, seq_len: int, hk: int, hv: int, d: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, hk, d, generator=gen).to(dtype)
    k = torch.randn(batch, seq_len, hk, d, generator=gen).to(dtype)
    v = torch.randn(batch, seq_len, hv, d, generator=gen).to(dtype)
    g = -torch.rand(batch, seq_len, hv, generator=gen) * 0.5  # log decay in [-0.5, 0]
    beta = torch.rand(batch, seq_len, hv, generator=gen).to(dtype)
    state = torch.randn(batch, hv, d, d, generator=gen) * 0.1
    return q, k, v, g, beta, state


@needs_cuda_and_fla
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize(
    ("form", "batch", "seq_len", "hk", "hv", "d"),
    [
        ("decode", 8, 1, 2, 6, 32),  # the tiny model's geometry, one token each
        ("prefill", 2, 100, 2, 6, 32),  # one full chunk and a partial one
        ("decode", 16, 1, 16, 48, 128),  # Flash-Next's GDN geometry
        ("prefill", 1, 300, 16, 48, 128),
    ],
)
def test_fla_delta_rule_matches_reference(
    dtype_name: str, form: str, batch: int, seq_len: int, hk: int, hv: int, d: int
) -> None:
    dtype = DTYPES[dtype_name]
    seed = 100 * list(DTYPES).index(dtype_name) + seq_len + d
    q, k, v, g, beta, state = rule_inputs(batch, seq_len, hk, hv, d, dtype, seed)
    o, final = gdn_cuda.gated_delta_rule_fla(*(t.cuda() for t in (q, k, v, g, beta, state)), chunked=form == "prefill")
    # the reference in fp32 on the same (rounded) inputs, on the CPU
    repeat = hv // hk
    qr, kr = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
    expected_o, expected_state = gdn.gated_delta_rule_chunked(qr.float(), kr.float(), v.float(), g, beta.float(), state)
    assert o.dtype == dtype and final.dtype == torch.float32
    errors = rel(o, expected_o), rel(final, expected_state)
    print(f"delta rule {form} B={batch} T={seq_len} Hk={hk} Hv={hv} D={d} {dtype_name}: rel o {errors[0]:.2e}, "
          f"state {errors[1]:.2e} (tol {RULE_TOL[dtype]:.0e})")  # fmt: skip
    assert max(errors) < RULE_TOL[dtype]


@needs_cuda_and_fla
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_gdn_layer_auto_uses_fla_and_matches_torch(dtype_name: str) -> None:
    dtype = DTYPES[dtype_name]
    args = layer_inputs(3, 70, 2, 6, 32, 32, dtype, "cuda", seed=7)
    for chunk_size in (64, None):  # prefill form, then (on one token) the decode form
        if chunk_size is None:
            args = {**args, "mixed_qkv": args["mixed_qkv"][:, :1], "z": args["z"][:, :1], "a": args["a"][:, :1],
                    "b": args["b"][:, :1]}  # fmt: skip
        fla_y, fla_conv, fla_state = gdn.gated_delta_net(**args, chunk_size=chunk_size, kernels="auto")
        y, conv, state = gdn.gated_delta_net(**args, chunk_size=chunk_size, kernels="torch")
        assert torch.equal(fla_conv, conv)  # the conv is plain torch on both paths
        errors = rel(fla_y, y), rel(fla_state, state)
        print(f"GDN layer chunk_size={chunk_size} {dtype_name}: rel y {errors[0]:.2e}, state {errors[1]:.2e}")
        # y passes a per-head RMSNorm, which rescales the delta rule's error: allow 2x
        assert errors[0] < 2 * RULE_TOL[dtype] and errors[1] < RULE_TOL[dtype]


def tiny_core(dtype: torch.dtype, device: str) -> Any:
    """The tiny test model (qwen38_plugin.tiny's geometry) with seeded random weights."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    from qwen38_plugin.model import Qwen4ExpCore
    from qwen38_plugin.tiny.checkpoints import DEFAULTS

    config = Qwen4ExpTextConfig(
        architectures=["Qwen4ExpForCausalLM"], eos_token_id=248046, pad_token_id=248044, **DEFAULTS["qwen4_exp_text"]
    )
    torch.manual_seed(0)
    hf = Qwen4ExpForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.is_floating_point() and not param.any():  # norms and PLE conv start at zero
                param.copy_(torch.randn(param.shape, generator=gen) * (0.1 if "norm" in name else 0.5))
    core = Qwen4ExpCore(config)
    core.load_checkpoint_tensors(hf.state_dict().items())
    return core.to(dtype).to(device).eval()


def greedy(core: Any, prompts: list[list[int]], kernels: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    from qwen38_plugin.model import greedy_generate

    monkeypatch.setenv(gdn.KERNELS_ENV, kernels)
    with torch.no_grad():
        return greedy_generate(core, prompts, 32)


@needs_cuda_and_fla
def test_tiny_model_on_cuda_matches_the_fp32_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    # 1 token, shorter than a QSA block, longer than the QSA budget and than one GDN chunk
    prompts = [torch.randint(0, 248_000, (n,), generator=gen).tolist() for n in (1, 3, 29, 90)]
    ref_tokens, ref_logits = greedy(tiny_core(torch.float32, "cuda"), prompts, "torch", monkeypatch)
    failures = []
    for name, dtype in DTYPES.items():
        core = tiny_core(dtype, "cuda")
        tokens, logits = greedy(core, prompts, "fla", monkeypatch)
        same_tokens, same_logits = greedy(core, prompts, "torch", monkeypatch)
        kernel_err = max(rel(a, b) for a, b in zip(logits, same_logits, strict=True))
        ref_err = max(rel(a, b) for a, b in zip(logits, ref_logits, strict=True))
        agree = sum(a == b for t, e in zip(tokens, ref_tokens, strict=True) for a, b in zip(t, e, strict=True))
        agree_same = sum(a == b for t, e in zip(tokens, same_tokens, strict=True) for a, b in zip(t, e, strict=True))
        total = sum(len(t) for t in tokens)
        print(f"tiny model on CUDA, {name}, fla GDN: last-logit rel vs fp32 reference {ref_err:.2e} (tol "
              f"{REF_TOL[dtype]:.0e}), vs plain-torch GDN same dtype {kernel_err:.2e} (tol {MODEL_TOL[dtype]:.0e}); "
              f"greedy tokens equal to the fp32 reference {agree}/{total}, to plain-torch same dtype "
              f"{agree_same}/{total}")  # fmt: skip
        if ref_err >= REF_TOL[dtype] or kernel_err >= MODEL_TOL[dtype]:
            failures.append(f"{name}: logits")
        if [t[0] for t in tokens] != [t[0] for t in ref_tokens]:
            failures.append(f"{name}: first greedy tokens")
        if dtype == torch.float32 and tokens != ref_tokens:
            failures.append("float32: greedy tokens")
    assert not failures, failures
