"""What `sm70_backend.register()` does inside vLLM."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys

from sm70_backend import __version__

SUPPORTED_VLLM_SERIES = ("0.32", "0.33")
BACKEND_CLASS = "sm70_backend.attention_backend.FlashAttnV100Backend"

# A child of the "vllm" logger, so vLLM's own logging configuration prints it
# with the process name and pid of whichever vLLM process ran the plugin.
logger = logging.getLogger("vllm.plugins.sm70_backend")


def _announce(message: str) -> None:
    # The API server loads plugins while it builds its argument parser, before vLLM has
    # configured logging; an INFO record would be dropped there, so print it instead.
    if logging.getLogger("vllm").handlers:
        logger.info(message)
    else:
        print(f"INFO [sm70_backend] {message}", file=sys.stderr, flush=True)


def register_attention_backend() -> str:
    """FLASH_ATTN_V100 as a new member of vLLM's AttentionBackendEnum (once per process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from sm70_backend.attention_backend import BACKEND_NAME

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_CLASS)
    elif AttentionBackendEnum[BACKEND_NAME].get_path() != BACKEND_CLASS:
        raise RuntimeError(
            f"attention backend {BACKEND_NAME} is already registered to "
            f"{AttentionBackendEnum[BACKEND_NAME].get_path()}, not sm70_backend's {BACKEND_CLASS}"
        )
    return f"attention backend {BACKEND_NAME}"


def register_awq() -> str:
    """The SM70 AWQ method as quantization ``awq_sm70`` (stock's ``awq`` is left as it is): it claims
    AWQ checkpoints on compute capability 7.x only, through ``override_quantization_method``."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from sm70_backend.awq_config import QUANT_NAME, Sm70AwqConfig

    register_quantization_config(QUANT_NAME)(Sm70AwqConfig)
    return f"quantization {QUANT_NAME!r}"


def register_with_vllm() -> list[str]:
    import vllm

    series = ".".join(vllm.__version__.split(".")[:2])
    if series not in SUPPORTED_VLLM_SERIES:
        raise RuntimeError(
            f"sm70_backend {__version__} supports vLLM {' and '.join(SUPPORTED_VLLM_SERIES)}, "
            f"found vLLM {vllm.__version__}: install a supported vLLM or remove sm70_backend "
            f"from VLLM_PLUGINS."
        )
    from sm70_backend.envs import register_with_vllm_envs

    registered = [f"env {', '.join(register_with_vllm_envs())}", register_attention_backend(), register_awq()]
    _announce(
        f"sm70_backend {__version__} registered in process {multiprocessing.current_process().name} "
        f"(pid {os.getpid()}): {'; '.join(registered)}"
    )
    return registered
