"""What the SM70 platform (`sm70_platform.Sm70CudaPlatform`) does differently from stock's CUDA
platform, as functions that import no CUDA part of vLLM (so they are tested on a CPU build):
`auto_backend` (FLASH_ATTN_V100 chosen automatically on compute capability 7.x) and
`apply_quirks` (bf16 -> fp16 with one log line, the fp16 range scan of the checkpoint, the SM70
multimodal default).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from sm70_backend import envs, quirks

# The backend module is imported when a layer asks (it imports vLLM's attention interface, which
# must not run while vLLM is still resolving its platform).
BACKEND_NAME = "FLASH_ATTN_V100"

logger = logging.getLogger("vllm.plugins.sm70_backend")
_announced: set[str] = set()


def _once(message: str, level: int = logging.INFO) -> None:
    if message not in _announced:
        _announced.add(message)
        logger.log(level, message)


def auto_backend(capability: Any, attn_selector_config: Any) -> str | None:
    """FLASH_ATTN_V100's class path for a layer it can serve on compute capability 7.x, else None."""
    if capability is None or capability.major != 7:
        return None
    from sm70_backend._registration import register_attention_backend
    from sm70_backend.attention_backend import FlashAttnV100Backend

    register_attention_backend()
    reasons = FlashAttnV100Backend.validate_configuration(
        device_capability=capability, **attn_selector_config._asdict()
    )
    if reasons:
        _once(
            f"sm70_backend: {BACKEND_NAME} cannot serve a layer with {attn_selector_config!r}: "
            f"{'; '.join(reasons)}; vLLM's own backend selection follows",
            logging.WARNING,
        )
        return None
    _once(f"Using {BACKEND_NAME} attention backend (compute capability {capability.major}.{capability.minor})")
    return AttentionBackendEnum[BACKEND_NAME].get_path()


def use_sm70_worker(vllm_config: Any) -> None:
    """Stock's default GPU worker -> `worker.Sm70Worker` (a worker the user chose is kept)."""
    parallel_config = getattr(vllm_config, "parallel_config", None)
    if parallel_config is not None and parallel_config.worker_cls == "vllm.v1.worker.gpu_worker.Worker":
        parallel_config.worker_cls = "sm70_backend.worker.Sm70Worker"


def _uses_flash_v100(vllm_config: Any) -> bool:
    attention_config = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention_config, "backend", None)
    return backend is None or getattr(backend, "name", backend) == BACKEND_NAME


def mm_default_applies(vllm_config: Any) -> bool:
    """Whether the SM70 multimodal default (R14) governs this config's per-request limits."""
    model_config = getattr(vllm_config, "model_config", None)
    mm_config = getattr(model_config, "multimodal_config", None)
    return mm_config is not None and _uses_flash_v100(vllm_config)


def apply_quirks(vllm_config: Any, capability: tuple[int, int]) -> None:
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return
    dtype, message = quirks.run_dtype_on_sm70(model_config.dtype, capability)
    if message:
        model_config.dtype = dtype
        _once(message)
    if model_config.dtype == torch.float16:
        _check_fp16_range(model_config)
    mm_config = getattr(model_config, "multimodal_config", None)
    if mm_config is not None and mm_default_applies(vllm_config):
        current = {name: options.count for name, options in mm_config.limit_per_prompt.items()}
        limits, message = quirks.sm70_mm_limits(current)
        if message:
            from vllm.config.multimodal import MultiModalConfig

            counts: dict[str, int | dict[str, int]] = dict(limits)
            mm_config.limit_per_prompt = MultiModalConfig._validate_limit_per_prompt(counts)
            _once(message)


def _check_fp16_range(model_config: Any) -> None:
    setting = envs.get("VLLM_SM70_FP16_RANGE_CHECK")
    source = getattr(getattr(model_config, "hf_config", None), "dtype", None)
    source = getattr(model_config.hf_config, "torch_dtype", None) if source is None else source
    if setting == "off" or source not in (torch.bfloat16, torch.float32, "bfloat16", "float32"):
        return
    directory = Path(str(model_config.model))
    if not directory.is_dir():
        _once(f"sm70_backend: float16 range scan skipped: {directory} is not a local directory", logging.WARNING)
        return
    violations = quirks.fp16_range_violations(quirks.checkpoint_tensors(directory))
    if not violations:
        _once(f"sm70_backend: every weight of {directory} fits float16's range")
        return
    report = quirks.fp16_range_report(violations)
    if setting == "error":
        raise ValueError(f"{report}\nSet VLLM_SM70_FP16_RANGE_CHECK=warn to start anyway.")
    _once(report, logging.WARNING)
