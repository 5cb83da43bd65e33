"""Triton for vLLM's own kernels on a machine without a GPU, in a subprocess made for it.

vLLM's CPU build turns Triton off when no GPU driver is active: `vllm.triton_utils` then hands out
placeholders and vLLM's kernels are plain functions. `enable()`, called before vLLM is imported,
tells `vllm.triton_utils` that Triton is there, so vLLM's kernels are Triton kernels again: to be
compiled for a GPU target, or run by Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors.
Only for a process that runs nothing else of vLLM's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

IMPORTING = "vllm.triton_utils.importing"
ROOT = Path(__file__).resolve().parents[1]


def enable() -> None:
    if "vllm.triton_utils" in sys.modules:
        raise RuntimeError("tests.vllm_triton.enable() must run before vLLM's triton_utils is imported")
    importing = types.ModuleType(IMPORTING)
    importing.HAS_TRITON = True  # type: ignore[attr-defined]
    importing.TritonPlaceholder = importing.TritonLanguagePlaceholder = object  # type: ignore[attr-defined]
    sys.modules[IMPORTING] = importing


def call_in_subprocess(module: str, function: str, env: Mapping[str, str] | None = None, timeout: float = 600) -> Any:
    """`module.function()`'s JSON result, called in a fresh Python with vLLM's Triton on."""
    script = (
        "import json\n"
        "import tests.vllm_triton\n"
        "tests.vllm_triton.enable()\n"
        f"from {module} import {function}\n"
        f"print('REPORT ' + json.dumps({function}()))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("REPORT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("REPORT "))
