"""Issue 13 item 5: encoder-cache entries own their memory.

Stock's Qwen4Exp multimodal model (Qwen3-VL's `embed_multimodal`) returns its batch's vision
output split into per-item views; vLLM's model runner caches each item under its hash
(`GPUModelRunner._cache_encoder_output`, also the CPU runner's) and evicts items one at a time.
Both classes the plugin's dispatcher for the architecture builds (stock's, where it runs, and the
portable one) give each item its own memory. Checked on stock's own `embed_multimodal` path (the
vision tower replaced by a stand-in: stock's model cannot be built on CPU), cached and partly
evicted through stock's runner method.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from qwen38_plugin.encoder_outputs import bytes_held, own_memory, owns_its_memory, storage_bytes

ARCH = "Qwen4ExpForConditionalGeneration"


def test_own_memory_copies_views_only() -> None:
    batch = torch.randn(10, 8)
    items = batch.split([3, 3, 4])
    assert all(storage_bytes(item) == batch.nbytes for item in items)  # each keeps the whole batch
    owned = own_memory(items)
    for item, copy in zip(items, owned, strict=True):
        assert torch.equal(item, copy) and owns_its_memory(copy) and storage_bytes(copy) == copy.nbytes
    alone = torch.randn(4, 8)
    assert own_memory([alone])[0] is alone  # already its own: not copied


class StandInTower(nn.Module):
    """Returns what a vision tower returns: one [merged patches, hidden] tensor for the batch."""

    spatial_merge_size = 2
    dtype = torch.float32

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        tokens = int(grid_thw.prod(-1).sum()) // self.spatial_merge_size**2
        return torch.randn(tokens, self.hidden, generator=torch.Generator().manual_seed(0))


def model_without_init(cls: type) -> Any:
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    model.visual = StandInTower(hidden=256)
    model.use_data_parallel = False
    model.is_multimodal_pruning_enabled = False
    return model


@pytest.fixture(scope="module")
def classes() -> tuple[type, type]:
    """Stock's class and the one the plugin builds where stock's runs (the dispatcher's choice on
    CUDA >= 8.0 in bf16)."""
    from vllm.models.qwen4_exp import Qwen4ExpForConditionalGeneration as stock

    from qwen38_plugin.vllm_mm_model import OwnedMemoryQwen4ExpForConditionalGeneration

    return stock, OwnedMemoryQwen4ExpForConditionalGeneration


def test_registered_class_is_stocks_with_stocks_processor(classes: tuple[type, type]) -> None:
    from vllm.model_executor.models import ModelRegistry

    import qwen38_plugin
    from qwen38_plugin.dispatch import STOCK_MODELS

    stock, ours = classes
    assert ours is not stock and issubclass(ours, stock) and ours.is_qwen38_owned_encoder_outputs
    assert ours._processor_factory is stock._processor_factory  # stock's multimodal processor
    # It changes nothing else: its own attributes are the marker and embed_multimodal.
    assert {name for name in vars(ours) if not name.startswith("_")} == {
        "is_qwen38_owned_encoder_outputs",
        "embed_multimodal",
    }
    # The registered class is the dispatcher; where stock's runs it builds this class.
    qwen38_plugin.register()
    registered = ModelRegistry._try_load_model_cls(ARCH)
    assert registered.is_qwen38_dispatcher and issubclass(registered, ours)
    assert STOCK_MODELS[ARCH] == f"{ours.__module__}:{ours.__name__}"


def cache_then_evict(model: Any) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], int]:
    """Three images encoded in one batch, cached by stock's runner method; two of them evicted."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    grid = torch.tensor([[1, 8, 8], [1, 4, 4], [1, 16, 8]])  # 16, 4 and 32 merged patches
    pixel_values = torch.zeros(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16)  # patches x (C * T * 16 * 16)
    outputs = model.embed_multimodal(pixel_values=pixel_values, image_grid_thw=grid)
    runner = SimpleNamespace(encoder_cache={}, maybe_save_ec_to_connector=lambda cache, mm_hash: None)
    for mm_hash, output in zip(("a", "b", "c"), outputs, strict=True):
        GPUModelRunner._cache_encoder_output(runner, mm_hash, output, None, [])
    batch_bytes = sum(o.nbytes for o in outputs)
    runner.encoder_cache.pop("a")
    runner.encoder_cache.pop("c")
    return runner.encoder_cache, list(outputs), batch_bytes


@pytest.mark.parametrize("implementation", ["stock's", "portable"])
def test_partial_eviction_frees_the_evicted_items(classes: tuple[type, type], implementation: str) -> None:
    from qwen38_plugin.vllm_mm_model import PortableQwen4ExpForConditionalGeneration

    stock, ours = classes
    if implementation == "portable":  # the same embed_multimodal: stock's, owning its outputs
        ours = PortableQwen4ExpForConditionalGeneration
    stock_cache, stock_out, batch_bytes = cache_then_evict(model_without_init(stock))
    our_cache, our_out, _ = cache_then_evict(model_without_init(ours))
    item_bytes = 4 * 256 * 4  # image "b": 4 merged patches x 256 channels, fp32
    # Stock's: the one entry left keeps all three images' memory alive.
    assert bytes_held(stock_cache.values()) == batch_bytes == 52 * 256 * 4
    # Ours: it keeps its own 4 KiB only; the values are stock's.
    assert bytes_held(our_cache.values()) == item_bytes
    assert all(torch.equal(s, o) for s, o in zip(stock_out, our_out, strict=True))
