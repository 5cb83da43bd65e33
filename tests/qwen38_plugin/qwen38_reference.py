"""Helpers shared by the qwen38_plugin tests: the transformers oracle and error measures."""

from __future__ import annotations

from pathlib import Path

import torch

# transformers is the semantic reference; the tests never compare our code with itself
# except to check that streaming forms equal the full-sequence form.
from transformers import Qwen4ExpForCausalLM


def load_reference(path: Path, dtype: torch.dtype = torch.float32) -> Qwen4ExpForCausalLM:
    model = Qwen4ExpForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in fp32."""
    actual, expected = actual.float(), expected.float()
    scale = expected.abs().max().clamp_min(1e-30)
    return float((actual - expected).abs().max() / scale)
