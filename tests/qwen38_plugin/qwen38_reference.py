"""Helpers shared by the qwen38_plugin tests: the transformers oracle and error measures."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# transformers is the semantic reference; the tests never compare our code with itself
# except to check that streaming forms equal the full-sequence form.
from transformers import Qwen4ExpForCausalLM


def load_reference(path: Path, dtype: torch.dtype = torch.float32) -> Qwen4ExpForCausalLM:
    """transformers' Qwen4Exp from ``path``, on the CPU, with transformers' own torch functions."""
    _use_transformers_torch_functions()
    model = Qwen4ExpForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def _use_transformers_torch_functions() -> None:
    """The oracle runs on the CPU; where fla is installed (the GPU machines), transformers binds fla's
    Triton Gated DeltaNet kernels in place of its module's torch_* functions, and those refuse CPU
    tensors (2026-12-07, H100: "Pointer argument (at 0) cannot be accessed from Triton"). Each such
    function is put back to the torch code it wraps, for the process (a no-op where nothing is bound)."""
    import transformers.models.qwen4_exp.modeling_qwen4_exp as hf_qwen4

    for name in [n for n in vars(hf_qwen4) if n.startswith("torch_")]:
        bound = getattr(hf_qwen4, name)
        if callable(bound) and hasattr(bound, "__wrapped__"):
            setattr(hf_qwen4, name, inspect.unwrap(bound))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp32."""
    actual, expected = actual.float(), expected.float()
    scale = expected.abs().max().clamp_min(1e-30)
    return float((actual - expected).abs().max() / scale)


def reference_greedy_one(hf: Any, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens for one prompt and the logits of its last position."""
    ids = torch.tensor([prompt])
    # transformers' cache needs an attention layer (it counts the sequence length on one): a model
    # without any is decoded without a cache, each step a full forward.
    use_cache = "indexed_attention" in hf.config.layer_types
    logits = hf(ids, use_cache=use_cache).logits[0, -1]
    out = hf.generate(
        ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=use_cache
    )
    return out[0, len(prompt) :].tolist(), logits


def assert_fp32_equals_reference(hf: Any, core: Any, prompts: Sequence[list[int]], steps: int = 32) -> None:
    """Our core's prompts run together (`greedy_generate`) against transformers one by one:
    last-position logits within 1e-4 relative error and identical greedy tokens."""
    from qwen38_plugin.model import greedy_generate

    with torch.no_grad():
        ours, first_logits = greedy_generate(core, prompts, steps)
        for prompt, tokens, logits in zip(prompts, ours, first_logits, strict=True):
            expected_tokens, expected_logits = reference_greedy_one(hf, prompt, steps)
            assert rel_err(logits, expected_logits) < 1e-4
            assert tokens == expected_tokens


# The top-two logprob margin under which transformers' own greedy choice is a near-tie in a half
# precision: a few units of the format's resolution at the logits' scale (bf16 keeps 8 mantissa
# bits, fp16 11), so any other rounding order may choose the other token there.
NEAR_TIE = {torch.bfloat16: 2**-5, torch.float16: 2**-8}


def reference_greedy_margins(path: Path, prompts: Sequence[list[int]], steps: int, dtype: torch.dtype) -> tuple[
    list[list[int]], list[list[float]]
]:  # fmt: skip
    """transformers' greedy tokens per prompt and, at every step, the margin between its top two logprobs."""
    hf = load_reference(path, dtype)
    tokens, margins = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0,
                output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            top2 = [torch.log_softmax(s[0].float(), -1).topk(2).values for s in out.scores]
            margins.append([float(t[0] - t[1]) for t in top2])
    return tokens, margins


def assert_greedy_equal_until_near_tie(
    served: Sequence[list[int]], reference: Sequence[list[int]], margins: Sequence[list[float]], tolerance: float
) -> int:
    """Each served continuation equals transformers' up to its first differing step, and there
    transformers' top two logprobs are within ``tolerance`` (a near-tie, where a half precision
    may go either way; after it the continuations are different texts). Returns how many
    continuations are identical throughout."""
    identical = 0
    for prompt, (ours, theirs, margin) in enumerate(zip(served, reference, margins, strict=True)):
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if first is None:
            identical += 1
            continue
        assert margin[first] < tolerance, (
            f"prompt {prompt}: step {first} differs ({ours[first]} vs transformers' {theirs[first]}) where "
            f"transformers' top-two logprob margin is {margin[first]:.4f}, not a near-tie (< {tolerance})"
        )
    return identical
