"""Fixtures for the qwen38_plugin tests."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


def _use_the_real_package() -> None:
    # pytest puts tests/ on sys.path (tests/ has no __init__.py), where this directory, named
    # like the package, becomes a namespace package `qwen38_plugin` that hides the installed one.
    package = sys.modules.get("qwen38_plugin")
    if package is not None and getattr(package, "__file__", None) is not None:
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src" / "qwen38_plugin"))
    for name in [n for n in sys.modules if n == "qwen38_plugin" or n.startswith("qwen38_plugin.")]:
        del sys.modules[name]
    importlib.import_module("qwen38_plugin")


_use_the_real_package()


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # The tiny models do microsecond-sized ops; on a 2-core CI box shared with vLLM servers,
    # torch's two OpenMP threads spin-wait on each other and make them ~6x slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
