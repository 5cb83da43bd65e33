"""The plugin's ``VLLM_SM70_*`` environment variables.

`register_with_vllm_envs` adds each to ``vllm.envs.environment_variables``, vLLM's registry of
its variables: ``vllm.envs.VLLM_SM70_...`` then reads them, ``vllm.envs.is_set`` knows them, and
they enter vLLM's torch.compile cache key (`vllm.envs.compile_factors`) like vLLM's own. This
module itself imports nothing from vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

FP16_RANGE_CHECK_CHOICES = ("warn", "error", "off")


def _choice(name: str, default: str, choices: tuple[str, ...]) -> Callable[[], str]:
    def get() -> str:
        value = os.environ.get(name, default).strip().lower()
        if value not in choices:
            raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
        return value

    return get


def _optional_path(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or None


SM70_ENV_VARS: dict[str, Callable[[], Any]] = {
    # "auto": on a GPU of compute capability 7.x, vLLM runs the SM70 platform (FLASH_ATTN_V100
    # chosen automatically, the SM70 quirks); "off": stock's CUDA platform.
    "VLLM_SM70_PLATFORM": _choice("VLLM_SM70_PLATFORM", "auto", ("auto", "off")),
    # Weights of a bf16 / fp32 checkpoint outside fp16's range when it runs in fp16 on SM70:
    # "warn" (log each tensor), "error" (refuse to start), "off" (no scan).
    "VLLM_SM70_FP16_RANGE_CHECK": _choice("VLLM_SM70_FP16_RANGE_CHECK", "warn", FP16_RANGE_CHECK_CHOICES),
    # The NVRTC library to compile the kernels with (default: the one beside torch, see kernels.nvrtc).
    "VLLM_SM70_NVRTC_PATH": _optional_path("VLLM_SM70_NVRTC_PATH"),
    # Where compiled cubins are kept (default ~/.cache/vllm/sm70_backend).
    "VLLM_SM70_KERNEL_CACHE": _optional_path("VLLM_SM70_KERNEL_CACHE"),
}


def register_with_vllm_envs() -> list[str]:
    """Add the variables to vLLM's registry (idempotent); return their names."""
    import vllm.envs

    for name, getter in SM70_ENV_VARS.items():
        vllm.envs.environment_variables.setdefault(name, getter)
    return list(SM70_ENV_VARS)


def get(name: str) -> Any:
    return SM70_ENV_VARS[name]()
