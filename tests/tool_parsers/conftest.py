"""Fixtures for the tool_parsers tests: the real Qwen3.6 tokenizer of the tiny Qwen3 checkpoint."""

from __future__ import annotations

from typing import Any

import pytest

from tests.tool_parsers.qwen38_harness import Qwen38Harness


@pytest.fixture(scope="session")
def qwen3_tokenizer(tiny_checkpoint: Any) -> Any:
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(tiny_checkpoint("qwen3")))


@pytest.fixture(scope="session")
def harness(qwen3_tokenizer: Any) -> Qwen38Harness:
    return Qwen38Harness(qwen3_tokenizer)
