"""Triton for vLLM's own kernels on a machine without a GPU, in a subprocess made for it.

vLLM's CPU build turns Triton off when no GPU driver is active: `vllm.triton_utils` then hands out
placeholders and vLLM's kernels are plain functions. `enable()`, called before vLLM is imported,
tells `vllm.triton_utils` that Triton is there, so vLLM's kernels are Triton kernels again: to be
compiled for a GPU target, or run by Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors.
Only for a process that runs nothing else of vLLM's.
"""

from __future__ import annotations

import sys
import types

IMPORTING = "vllm.triton_utils.importing"


def enable() -> None:
    if "vllm.triton_utils" in sys.modules:
        raise RuntimeError("tests.vllm_triton.enable() must run before vLLM's triton_utils is imported")
    importing = types.ModuleType(IMPORTING)
    importing.HAS_TRITON = True  # type: ignore[attr-defined]
    importing.TritonPlaceholder = importing.TritonLanguagePlaceholder = object  # type: ignore[attr-defined]
    sys.modules[IMPORTING] = importing
