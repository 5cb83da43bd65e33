"""Speculative decoding with temperature > 0 on vLLM's CPU backend: stock 0.32 samples from garbage.

vLLM's rejection sampler spreads each request's temperature (and top-k / top-p) over its draft
tokens with `expand_batch_to_tokens`: ``expanded = x.new_empty(num_tokens)``, then the Triton
`expand_kernel` fills it. Without Triton, the CPU platform routes that kernel to
`vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands the C++ kernel
``_ensure_int64(output)``: for a float32 temperature (or an int32 top-k) that is a new int64
tensor, the kernel fills the copy, and ``expanded`` keeps whatever memory `new_empty` returned.
The target's logits at every draft position are then divided by that memory (seen: 3e-19, inf,
1e15), so the accept / reject decisions and the recovered tokens follow no distribution at all;
greedy requests are not affected (their logits are not scaled). Found by
tests/qwen38_plugin/test_qwen38_mtp_server.py: with MTP, 2 sampled tokens out of 2 were wrong in
distribution (chi-square 944 on 10 df) and 1.7 % of the drafts were accepted.

`install()` replaces `cpu_triton_utils._expand_kernel_impl` before the CPU platform registers its
kernel overrides (a general plugin's `register()` runs first in each worker,
`WorkerWrapperBase.init_worker`): int64 tensors still go to stock's C++ kernel, any other dtype is
expanded in torch with the kernel's semantics. Installed only on the CPU platform, and only while
stock's implementation still converts its output with `_ensure_int64(output)` and never copies
back (checked in its source; otherwise the fix is skipped and says why).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("vllm.plugins.qwen38_plugin")

_PATCHED = "_qwen38_expands_any_dtype"
STOCK_CAST = "_ensure_int64(output)"


def expand(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: Any,
    replace_to: Any,
    MAX_NUM_TOKENS: int | None = None,  # the Triton kernel's argument name
) -> None:
    """``output[cu[i-1]:cu[i]] = replace_to if input_val[i] == replace_from else input_val[i]``."""
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    expanded = values.repeat_interleave(counts)
    output[: expanded.shape[0]].copy_(expanded)


def fixed(stock: Callable[..., None]) -> Callable[..., None]:
    def expand_kernel_impl(
        output: torch.Tensor,
        input_val: torch.Tensor,
        cu_num_tokens: torch.Tensor,
        replace_from: Any,
        replace_to: Any,
        MAX_NUM_TOKENS: int | None = None,
    ) -> None:
        if output.dtype == torch.int64 and input_val.dtype == torch.int64:
            stock(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)
        else:
            expand(output, input_val, cu_num_tokens, replace_from, replace_to)

    setattr(expand_kernel_impl, _PATCHED, True)
    expand_kernel_impl.__wrapped_stock__ = stock  # type: ignore[attr-defined]
    return expand_kernel_impl


def install() -> str:
    """Install the fix in this process (CPU platform only); says what it did."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not CPU"
    from vllm.utils import cpu_triton_utils

    stock = cpu_triton_utils._expand_kernel_impl
    if getattr(stock, _PATCHED, False):
        return "installed"
    source = inspect.getsource(stock)
    if STOCK_CAST not in source:
        # vLLM changed under the fix: say so loudly instead of guessing (the test named here shows
        # whether a float output is written now)
        logger.error(
            "qwen38_plugin: vLLM's CPU _expand_kernel_impl no longer calls %s; the speculative-sampling fix is "
            "NOT installed. Check tests/qwen38_plugin/test_qwen38_cpu_spec_sampling.py against this vLLM before "
            "sampling with speculative decoding on CPU.",
            STOCK_CAST,
        )
        return "stock changed"
    if ".copy_(" in source:  # stock copies the int64 result back: fixed upstream
        return "not needed"
    cpu_triton_utils._expand_kernel_impl = fixed(stock)
    return "installed"
