"""Encoder outputs that own their memory (issue 13 item 5, row R26).

A multimodal model's `embed_multimodal` returns one tensor per item; stock's Qwen3-VL path (which
Qwen4Exp reuses) runs the vision tower once over the batch and returns `batch.split(sizes)`:
views that all keep the whole batch's storage alive. vLLM's encoder cache stores each item under
its hash and frees items one at a time, so an item that stays cached keeps every other item of
its batch in memory: partial eviction frees nothing (ReVolta 0.1.2: 9.1 MiB of entries held
1,118 MiB). `own_memory` gives each item that is a view of a larger storage a copy of its own
(values unchanged); an item that already owns its storage is returned as it is. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the storage `tensor` keeps alive (more than its own when it is a view)."""
    return int(tensor.untyped_storage().nbytes())


def owns_its_memory(tensor: torch.Tensor) -> bool:
    return storage_bytes(tensor) <= tensor.numel() * tensor.element_size()


def own_memory(outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Each item with a storage of its own (a contiguous copy where it was a view of a larger one)."""
    return tuple(
        item if owns_its_memory(item) else item.clone(memory_format=torch.contiguous_format) for item in outputs
    )


def bytes_held(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages a collection of tensors keeps alive."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
