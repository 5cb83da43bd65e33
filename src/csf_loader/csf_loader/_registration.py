"""What `csf_loader.register()` does inside vLLM."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys

from csf_loader import __version__

SUPPORTED_VLLM_SERIES = ("0.32", "0.33")

# A child of the "vllm" logger, so vLLM's own logging configuration prints it
# with the process name and pid of whichever vLLM process ran the plugin.
logger = logging.getLogger("vllm.plugins.csf_loader")


def _announce(message: str) -> None:
    # The API server loads plugins while it builds its argument parser, before vLLM has
    # configured logging; an INFO record would be dropped there, so print it instead.
    if logging.getLogger("vllm").handlers:
        logger.info(message)
    else:
        print(f"INFO [csf_loader] {message}", file=sys.stderr, flush=True)


def register_with_vllm() -> list[str]:
    import vllm

    series = ".".join(vllm.__version__.split(".")[:2])
    if series not in SUPPORTED_VLLM_SERIES:
        raise RuntimeError(
            f"csf_loader {__version__} supports vLLM {' and '.join(SUPPORTED_VLLM_SERIES)}, "
            f"found vLLM {vllm.__version__}: install a supported vLLM or remove csf_loader "
            f"from VLLM_PLUGINS."
        )
    registered: list[str] = []

    # The "csf" load format: stock's safetensors loader with CSF pairs decoded.
    from vllm.model_executor.model_loader import register_model_loader

    from csf_loader.vllm_loader import LOAD_FORMAT, CsfModelLoader

    register_model_loader(LOAD_FORMAT)(CsfModelLoader)
    registered.append(f"load format {LOAD_FORMAT!r}")

    # "mxfp4_csf": the quant_method an MXFP4-CSF container's config.json names.
    from vllm.model_executor.layers.quantization import register_quantization_config

    from csf_loader.vllm_loader import make_mxfp4_csf_config

    register_quantization_config("mxfp4_csf")(make_mxfp4_csf_config())
    registered.append("quantization 'mxfp4_csf'")

    # Stock ships an NVFP4 emulation kernel but lists it for CUDA and ROCm only; on the
    # CPU platform register it through stock's kernel registry so NVFP4 (and NVFP4-CSF)
    # checkpoints run there. Only the platform check runs here; nothing touches a GPU.
    from vllm.platforms import PlatformEnum, current_platform

    if current_platform.is_cpu():
        from vllm.model_executor.kernels.linear import register_linear_kernel
        from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel

        register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
        registered.append("NVFP4 emulation linear kernel for CPU")

    _announce(
        f"csf_loader {__version__} registered in process {multiprocessing.current_process().name} "
        f"(pid {os.getpid()}): {', '.join(registered) or 'nothing yet'}"
    )
    return registered
