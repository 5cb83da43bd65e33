"""What `qwen38_plugin.register()` does inside vLLM."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys

import torch

from qwen38_plugin import __version__
from qwen38_plugin.dispatch import (
    ARCHITECTURE,
    FORCE_ENV,
    Target,
    current_platform_target,
    read_force,
    why_stock_cannot_run,
)

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


# The dispatcher picks stock's or our implementation per model (platform, capability, dtype).
DISPATCH_MODEL = "qwen38_plugin.vllm_dispatch:Qwen4ExpForCausalLM"
MM_ARCHITECTURE = "Qwen4ExpForConditionalGeneration"
# The same rule for images and video: stock's (encoder outputs owning their memory) or portable.
MM_MODEL = "qwen38_plugin.vllm_mm_model:Qwen4ExpForConditionalGeneration"
MTP_ARCHITECTURE = "Qwen4ExpMTP"
MTP_MODEL = "qwen38_plugin.vllm_dispatch:Qwen4ExpMTP"


def portable_model_reason() -> str | None:
    """Why this process serves Qwen4Exp with the portable model whatever the model, or None.

    Only what the process alone decides (the switch, the platform); the dtype rule is applied
    per model by `qwen38_plugin.dispatch`.
    """
    forced = read_force()
    if forced == "1":
        return f"{FORCE_ENV}=1"
    if forced == "0":
        return None
    platform, capability = current_platform_target()
    # bfloat16 here: only the platform can rule stock's out before a model is chosen.
    return why_stock_cannot_run(Target(platform, capability, torch.bfloat16))


def _registration_summary() -> str:
    reason = portable_model_reason()  # also refuses a bad QWEN38_FORCE_PORTABLE value
    if reason is not None:
        return f"portable {ARCHITECTURE} ({reason})"
    if read_force() == "0":
        return f"{ARCHITECTURE} dispatcher ({FORCE_ENV}=0: stock's only)"
    return f"{ARCHITECTURE} dispatcher (stock's in bfloat16, portable otherwise)"


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
    summary = _registration_summary()  # also refuses a bad QWEN38_FORCE_PORTABLE value
    from qwen38_plugin.cpu_seeded_sampling import install as install_cpu_seeded_sampling_fix

    if install_cpu_seeded_sampling_fix() != "not CPU":
        registered.append("CPU seeded-sampling fix")
    from qwen38_plugin.cpu_spec_sampling import install as install_cpu_spec_sampling_fix

    if install_cpu_spec_sampling_fix() == "installed":
        registered.append("CPU speculative-sampling expand fix")
    from qwen38_plugin.vllm_multimodal import install as install_multimodal_defaults

    registered += [f"multimodal defaults for {name}" for name in install_multimodal_defaults()]
    from vllm import ModelRegistry

    # A lazy "module:Class" reference: vLLM imports the dispatcher only when it inspects or
    # builds the architecture; the dispatcher logs which implementation it chose and why.
    ModelRegistry.register_model(ARCHITECTURE, DISPATCH_MODEL)
    # Stock's multimodal model (its encoder outputs owning their memory, issue 13 item 5) or the
    # portable one, chosen per model by the same rule.
    ModelRegistry.register_model(MM_ARCHITECTURE, MM_MODEL)
    registered.append(f"{MM_ARCHITECTURE} dispatcher (the same rule)")
    # The MTP drafter (stock's or the portable head, by the same rule) and the config hook that
    # sizes vLLM's MTP proposer buffer for the target's hc * H residual streams.
    ModelRegistry.register_model(MTP_ARCHITECTURE, MTP_MODEL)
    registered.append(f"{MTP_ARCHITECTURE} dispatcher (the same rule)")
    from qwen38_plugin.vllm_config_hook import install as install_config_hook

    registered += install_config_hook()
    registered.append(summary)

    _announce(
        f"qwen38_plugin {__version__} registered in process {multiprocessing.current_process().name} "
        f"(pid {os.getpid()}): {', '.join(registered) or 'nothing yet'}"
    )
    return registered
