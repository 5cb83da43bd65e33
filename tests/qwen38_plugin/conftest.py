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


@pytest.fixture(scope="session")
def vllm_single_rank(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM's distributed state for one rank in this process, which vLLM's parallel layers need
    when a test builds a model outside an engine."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    method = f"file://{tmp_path_factory.mktemp('dist') / 'init'}"
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, distributed_init_method=method, local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
