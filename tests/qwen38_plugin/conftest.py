"""Fixtures for the qwen38_plugin tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # The tiny models do microsecond-sized ops; on a 2-core CI box shared with vLLM servers,
    # torch's two OpenMP threads spin-wait on each other and make them ~6x slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
