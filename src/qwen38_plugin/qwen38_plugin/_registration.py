"""What `qwen38_plugin.register()` does inside vLLM."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys

from qwen38_plugin import __version__

SUPPORTED_VLLM_SERIES = ("0.32", "0.33")

# A child of the "vllm" logger, so vLLM's own logging configuration prints it
# with the process name and pid of whichever vLLM process ran the plugin.
logger = logging.getLogger("vllm.plugins.qwen38_plugin")


def _announce(message: str) -> None:
    # The API server loads plugins while it builds its argument parser, before vLLM has
    # configured logging; an INFO record would be dropped there, so print it instead.
    if logging.getLogger("vllm").handlers:
        logger.info(message)
    else:
        print(f"INFO [qwen38_plugin] {message}", file=sys.stderr, flush=True)


PORTABLE_ARCHITECTURE = "Qwen4ExpForCausalLM"
PORTABLE_MODEL = "qwen38_plugin.vllm_model:PortableQwen4ExpForCausalLM"

# QWEN38_FORCE_PORTABLE=1 serves Qwen4Exp with our portable model even where stock vLLM's own
# implementation runs (CUDA >= 8.0 in bf16), to compare the two; =0 never replaces stock's.
FORCE_ENV = "QWEN38_FORCE_PORTABLE"


def portable_model_reason() -> str | None:
    """Why this process should serve Qwen4Exp with the portable model, or None to leave stock's."""
    forced = os.environ.get(FORCE_ENV, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{FORCE_ENV}={forced!r}: use 1 (always the portable model) or 0 (never)")
    if forced == "1":
        return f"{FORCE_ENV}=1"
    if forced == "0":
        return None
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "CPU platform"
    if current_platform.is_cuda():
        capability = current_platform.get_device_capability()
        if capability is not None and capability.to_int() < 80:
            return f"CUDA capability {capability.major}.{capability.minor} < 8.0"
    return None


def register_with_vllm() -> list[str]:
    import vllm

    series = ".".join(vllm.__version__.split(".")[:2])
    if series not in SUPPORTED_VLLM_SERIES:
        raise RuntimeError(
            f"qwen38_plugin {__version__} supports vLLM {' and '.join(SUPPORTED_VLLM_SERIES)}, "
            f"found vLLM {vllm.__version__}: install a supported vLLM or remove qwen38_plugin "
            f"from VLLM_PLUGINS."
        )
    from qwen38_plugin.configs import register_alias_configs

    registered = [f"transformers config {name}" for name in register_alias_configs()]
    reason = portable_model_reason()
    if reason is not None:
        from vllm import ModelRegistry

        # A lazy "module:Class" reference: vLLM imports the model module only when it builds it.
        ModelRegistry.register_model(PORTABLE_ARCHITECTURE, PORTABLE_MODEL)
        registered.append(f"portable {PORTABLE_ARCHITECTURE} ({reason})")

    _announce(
        f"qwen38_plugin {__version__} registered in process {multiprocessing.current_process().name} "
        f"(pid {os.getpid()}): {', '.join(registered) or 'nothing yet'}"
    )
    return registered
