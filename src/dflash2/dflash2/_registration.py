"""What `dflash2.register()` does inside vLLM."""

from __future__ import annotations

import logging
import multiprocessing
import os

from dflash2 import __version__

SUPPORTED_VLLM_SERIES = ("0.32", "0.33")

# A child of the "vllm" logger, so vLLM's own logging configuration prints it
# with the process name and pid of whichever vLLM process ran the plugin.
logger = logging.getLogger("vllm.plugins.dflash2")


def register_with_vllm() -> list[str]:
    import vllm

    series = ".".join(vllm.__version__.split(".")[:2])
    if series not in SUPPORTED_VLLM_SERIES:
        raise RuntimeError(
            f"dflash2 {__version__} supports vLLM {' and '.join(SUPPORTED_VLLM_SERIES)}, "
            f"found vLLM {vllm.__version__}: install a supported vLLM or remove dflash2 "
            f"from VLLM_PLUGINS."
        )
    # The DFlash2 drafter hooks land here; until then the plugin loads and
    # registers nothing.
    registered: list[str] = []

    logger.info(
        "dflash2 %s registered in process %s (pid %d): %s",
        __version__,
        multiprocessing.current_process().name,
        os.getpid(),
        ", ".join(registered) or "nothing yet",
    )
    return registered
