"""The CPU expand-kernel fix (`qwen38_plugin.cpu_spec_sampling`): stock vLLM 0.32's CPU
`_expand_kernel_impl` leaves a float32 (or int32) output unwritten, so the rejection sampler
divides draft-position logits by uninitialised memory; the fix expands any dtype as the Triton
kernel does. End to end: test_qwen38_mtp_server.py's sampling test."""

from __future__ import annotations

import pytest
import torch
from vllm.platforms import current_platform
from vllm.utils import cpu_triton_utils

from qwen38_plugin import cpu_spec_sampling

# The CPU kernels stock routes to, loaded as vLLM loads them: `vllm._C`, `_C_AVX512` or `_C_AVX2` by
# the CPU's instruction set (each registers the same op namespace, so importing a second one aborts).
current_platform.import_kernels()

STOCK = getattr(cpu_triton_utils._expand_kernel_impl, "__wrapped_stock__", cpu_triton_utils._expand_kernel_impl)
CU = torch.tensor([3, 3, 4, 7])  # 3 drafts, 0, 1, 3
GREEDY = -1  # the value replaced (vLLM passes its greedy temperature)


def expected(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    rows = [[v if v != GREEDY else 1] * n for v, n in zip(values, (3, 0, 1, 3), strict=True)]
    return torch.tensor([x for row in rows for x in row], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
def test_fixed_expand_fills_every_dtype(dtype: torch.dtype) -> None:
    values = [0.5, 2.0, GREEDY, 1.5] if dtype.is_floating_point else [5, 7, GREEDY, 9]
    x = torch.tensor(values, dtype=dtype)
    out = torch.full((7,), 123, dtype=dtype)
    cpu_spec_sampling.fixed(STOCK)(out, x, CU, GREEDY, 1)
    assert torch.equal(out, expected(values, dtype))


def test_stock_expand_leaves_a_float_output_unwritten() -> None:
    # what the fix is for: stock's C++ kernel fills an int64 copy of a float32 output
    if cpu_spec_sampling.install() == "not CPU":
        pytest.skip("the CPU platform only")
    x = torch.tensor([0.5, 2.0, 1.0, 1.5])
    out = torch.full((7,), 123.0)
    STOCK(out, x, CU, GREEDY, 1)
    assert torch.equal(out, torch.full((7,), 123.0))
    assert getattr(cpu_triton_utils._expand_kernel_impl, cpu_spec_sampling._PATCHED)


def test_a_changed_stock_kernel_is_named_not_patched(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM changing under the fix must be said loudly, and the unknown kernel left alone
    if cpu_spec_sampling.install() == "not CPU":
        pytest.skip("the CPU platform only")

    def rewritten(output: torch.Tensor, input_val: torch.Tensor, *args: object) -> None:
        output.zero_()

    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", rewritten)
    with caplog.at_level("ERROR", logger="vllm.plugins.qwen38_plugin"):
        assert cpu_spec_sampling.install() == "stock changed"
    assert cpu_triton_utils._expand_kernel_impl is rewritten
    assert "NOT installed" in caplog.text and cpu_spec_sampling.STOCK_CAST in caplog.text
