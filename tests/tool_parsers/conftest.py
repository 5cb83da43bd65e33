"""Fixtures for the tool_parsers tests: the real Qwen3.6 tokenizer of the tiny Qwen3 checkpoint."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest


def _import_installed_tool_parsers() -> None:
    # The root conftest puts tests/ on sys.path, where this directory would be found as a
    # namespace package "tool_parsers" before the installed (editable) plugin package.
    tests_dir = Path(__file__).resolve().parent.parent
    module = sys.modules.get("tool_parsers")
    if module is not None and getattr(module, "__file__", None):
        return
    sys.modules.pop("tool_parsers", None)
    saved = list(sys.path)
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != tests_dir]
    try:
        importlib.import_module("tool_parsers")
    finally:
        sys.path[:] = saved


_import_installed_tool_parsers()

from qwen38_harness import Qwen38Harness  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_tokenizer(tiny_checkpoint: Any) -> Any:
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(tiny_checkpoint("qwen3")))


@pytest.fixture(scope="session")
def harness(qwen3_tokenizer: Any) -> Qwen38Harness:
    return Qwen38Harness(qwen3_tokenizer)
