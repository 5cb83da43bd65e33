"""What `dflash2.register()` does inside vLLM."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys

from dflash2 import __version__

SUPPORTED_VLLM_SERIES = ("0.32", "0.33")
DRAFTER_ARCHITECTURE = "DFlashDraftModel"
DRAFTER_CLASS = "dflash2.vllm_drafter:DFlashColumnParallelFcForCausalLM"

# A child of the "vllm" logger, so vLLM's own logging configuration prints it
# with the process name and pid of whichever vLLM process ran the plugin.
logger = logging.getLogger("vllm.plugins.dflash2")


def _announce(message: str) -> None:
    # The API server loads plugins while it builds its argument parser, before vLLM has
    # configured logging; an INFO record would be dropped there, so print it instead.
    if logging.getLogger("vllm").handlers:
        logger.info(message)
    else:
        print(f"INFO [dflash2] {message}", file=sys.stderr, flush=True)


def register_with_vllm() -> list[str]:
    import vllm

    series = ".".join(vllm.__version__.split(".")[:2])
    if series not in SUPPORTED_VLLM_SERIES:
        raise RuntimeError(
            f"dflash2 {__version__} supports vLLM {' and '.join(SUPPORTED_VLLM_SERIES)}, "
            f"found vLLM {vllm.__version__}: install a supported vLLM or remove dflash2 "
            f"from VLLM_PLUGINS."
        )
    from dflash2 import speculative_args

    registered: list[str] = []
    # Raises StockChanged on a vLLM whose EngineArgs it does not know (vLLM logs the failure).
    speculative_args.install()
    registered.append(f"--speculative-config key {speculative_args.LADDER_KEY}")
    from vllm import ModelRegistry

    from dflash2 import vllm_acceptance

    # K20: adaptive verification's estimator with a trust region and exploration, swapped in when
    # Model Runner V2 (GPU) imports stock's (a post-import hook: nothing is imported here).
    estimator = vllm_acceptance.install()
    if estimator is not None:
        registered.append(estimator)
    # Stock's DFlash drafter with a column-parallel fc at TP > 1 (K17); at TP = 1 it is stock's.
    ModelRegistry.register_model(DRAFTER_ARCHITECTURE, DRAFTER_CLASS)
    registered.append(f"{DRAFTER_ARCHITECTURE} with a column-parallel fc")

    _announce(
        f"dflash2 {__version__} registered in process {multiprocessing.current_process().name} "
        f"(pid {os.getpid()}): {', '.join(registered) or 'nothing yet'}"
    )
    return registered
