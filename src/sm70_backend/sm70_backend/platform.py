"""The ``vllm.platform_plugins`` entry point: on a GPU of compute capability 7.x, vLLM runs
`sm70_platform.Sm70CudaPlatform` (stock's CUDA platform plus FLASH_ATTN_V100 chosen
automatically and the SM70 quirks); everywhere else this returns None and vLLM's own platform
detection is unchanged. It asks NVML (as vLLM's CUDA detection does), never initialises CUDA,
and imports nothing heavy when it does not activate.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm.plugins.sm70_backend")

PLATFORM_QUALNAME = "sm70_backend.sm70_platform.Sm70CudaPlatform"


def should_activate(capability: tuple[int, int] | None, setting: str) -> bool:
    return setting == "auto" and capability is not None and capability[0] == 7


def first_visible_gpu_capability() -> tuple[int, int] | None:
    """Compute capability of the first GPU CUDA_VISIBLE_DEVICES names (the device vLLM checks), via NVML."""
    from vllm.utils.import_utils import import_pynvml

    pynvml = import_pynvml()
    pynvml.nvmlInit()
    try:
        if pynvml.nvmlDeviceGetCount() <= 0:
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        first = visible.split(",")[0].strip() if visible else "0"
        if first == "" or first.startswith("-"):
            return None
        if first.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(first)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        return int(major), int(minor)
    finally:
        pynvml.nvmlShutdown()


def sm70_platform_plugin() -> str | None:
    from sm70_backend import envs

    setting = envs.get("VLLM_SM70_PLATFORM")
    if setting == "off":
        return None
    try:
        from vllm.platforms import vllm_version_matches_substr

        if vllm_version_matches_substr("cpu"):  # a CPU build of vLLM never runs the CUDA platform
            return None
        capability = first_visible_gpu_capability()
    except Exception as error:  # no NVML, no GPU: not ours
        logger.debug("sm70_backend: no SM70 platform (%s)", error)
        return None
    return PLATFORM_QUALNAME if should_activate(capability, setting) else None
