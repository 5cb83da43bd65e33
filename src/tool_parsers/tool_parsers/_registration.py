"""What `tool_parsers.register()` does inside vLLM."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys

from tool_parsers import __version__

SUPPORTED_VLLM_SERIES = ("0.32", "0.33")
TOOL_PARSER_NAME = "qwen38_coder"
REASONING_PARSER_NAME = "qwen38"
PARSER_MODULE = "tool_parsers.qwen38"

# A child of the "vllm" logger, so vLLM's own logging configuration prints it
# with the process name and pid of whichever vLLM process ran the plugin.
logger = logging.getLogger("vllm.plugins.tool_parsers")


def _announce(message: str) -> None:
    # The API server loads plugins while it builds its argument parser, before vLLM has
    # configured logging; an INFO record would be dropped there, so print it instead.
    if logging.getLogger("vllm").handlers:
        logger.info(message)
    else:
        print(f"INFO [tool_parsers] {message}", file=sys.stderr, flush=True)


def register_with_vllm() -> list[str]:
    import vllm

    series = ".".join(vllm.__version__.split(".")[:2])
    if series not in SUPPORTED_VLLM_SERIES:
        raise RuntimeError(
            f"tool_parsers {__version__} supports vLLM {' and '.join(SUPPORTED_VLLM_SERIES)}, "
            f"found vLLM {vllm.__version__}: install a supported vLLM or remove tool_parsers "
            f"from VLLM_PLUGINS."
        )
    # Lazy registrations: the parser module (and the vLLM parser engine it builds on) is
    # imported only when a server asks for these names, so register() stays cheap in the
    # engine core and worker processes.
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    ToolParserManager.register_lazy_module(TOOL_PARSER_NAME, PARSER_MODULE, "Qwen38CoderToolParser")
    ReasoningParserManager.register_lazy_module(REASONING_PARSER_NAME, PARSER_MODULE, "Qwen38ReasoningParser")
    registered = [f"tool parser {TOOL_PARSER_NAME}", f"reasoning parser {REASONING_PARSER_NAME}"]

    _announce(
        f"tool_parsers {__version__} registered in process {multiprocessing.current_process().name} "
        f"(pid {os.getpid()}): {', '.join(registered) or 'nothing yet'}"
    )
    return registered
