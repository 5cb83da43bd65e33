"""vLLM's CPU kernels inside the portable model (`qwen38_plugin.vllm_cpu_kernels`): with them
installed, the model still equals transformers' Qwen4ExpForCausalLM (fp32 logits within 1e-4 and
32 identical greedy tokens; bf16 logits within the half-precision tolerance of the model tests).

The engine tests (test_qwen38_vllm_engine, test_qwen38_tp_engine) run with the kernels too, since
vLLM installs them by default on CPU; these tests pin the kernels themselves, without an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from qwen38_plugin import vllm_cpu_kernels
from qwen38_plugin.model import Projection, Qwen4ExpCore, SparseMoe, greedy_generate, iter_safetensors
from tests.qwen38_plugin.qwen38_reference import assert_fp32_equals_reference, load_reference, rel_err
from tests.qwen38_plugin.test_qwen38_model import HALF_LOGIT_TOL, _prompts

# The tiny model's routed experts (32) fit the fused kernel's tile; 24 and a 40-wide shared expert
# need zero padding, and the shared expert then spans two pieces.
SHAPES = {
    "tiny": {},
    "padded": {"moe_intermediate_size": 24, "shared_expert_intermediate_size": 40},
}


def _core_with_kernels(path: Path, dtype: torch.dtype) -> tuple[Qwen4ExpCore, dict[str, str]]:
    core = Qwen4ExpCore(AutoConfig.from_pretrained(path)).to(dtype)
    core.load_checkpoint_tensors(iter_safetensors(path))
    core.eval()
    return core, vllm_cpu_kernels.install(core)


@pytest.mark.parametrize("name", list(SHAPES))
def test_fp32_with_vllm_kernels_equals_transformers(tiny_checkpoint: Callable[..., Path], name: str) -> None:
    path = tiny_checkpoint("qwen4_exp_text", overrides=SHAPES[name])
    hf = load_reference(path, torch.float32)
    core, used = _core_with_kernels(path, torch.float32)
    assert set(used) == {"projections", "experts"}, used
    # every projection and every MoE block really runs through a kernel, the weights were handed over
    projections = [m for m in core.modules() if isinstance(m, Projection)]
    assert projections and all(m.kernel is not None and m.weight.numel() == 0 for m in projections)
    assert all(m.experts_kernel is not None for m in core.modules() if isinstance(m, SparseMoe))
    assert_fp32_equals_reference(hf, core, _prompts(11))


def test_bf16_with_vllm_kernels_matches_transformers(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("qwen4_exp_text")
    hf = load_reference(path, torch.bfloat16)
    core, used = _core_with_kernels(path, torch.bfloat16)
    assert "experts" in used, used
    prompts = _prompts(7)
    with torch.no_grad():
        _, first_logits = greedy_generate(core, prompts, 1)
        for prompt, logits in zip(prompts, first_logits, strict=True):
            expected = hf(torch.tensor([prompt])).logits[0, -1]
            assert rel_err(logits, expected) < HALF_LOGIT_TOL[torch.bfloat16]


def test_fp16_experts_stay_on_the_reference_and_say_so(tiny_checkpoint: Callable[..., Path]) -> None:
    core, used = _core_with_kernels(tiny_checkpoint("qwen4_exp_text"), torch.float16)
    assert "experts" not in used
    assert "float16" in used["experts (reference)"]
    assert all(m.experts_kernel is None for m in core.modules() if isinstance(m, SparseMoe))


def test_switch_is_validated() -> None:
    assert vllm_cpu_kernels.enabled({}) and vllm_cpu_kernels.enabled({"QWEN38_CPU_KERNELS": "1"})
    assert not vllm_cpu_kernels.enabled({"QWEN38_CPU_KERNELS": "0"})
    with pytest.raises(ValueError, match="QWEN38_CPU_KERNELS='yes': use 1"):
        vllm_cpu_kernels.enabled({"QWEN38_CPU_KERNELS": "yes"})
