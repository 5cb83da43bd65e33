"""The K/V slot mapping of a decode-context-parallel rank on CPU (`cpu_context_parallel`), against a
per-token transcription of vLLM's CUDA kernel (`ComputeSlotMappingKernel.kernel` in
vllm/v1/worker/block_table.py), and the split it makes: every position on exactly one rank, no
two positions of a rank in one row. The engine it serves: test_qwen38_tp_engine.py (DCP 2)."""

from __future__ import annotations

import pytest
import torch

from qwen38_plugin.cpu_context_parallel import split_slot_mapping
from qwen38_plugin.ops.qsa_paged import DcpShard

BLOCK_SIZE = 8


def kernel_transcription(
    query_start_loc: list[int], positions: list[int], table: torch.Tensor, max_tokens: int, shard: DcpShard
) -> list[int]:
    """vLLM's kernel, token by token: virtual blocks of BS * N positions, rank (offset // I) % N."""
    slots = [-1] * max_tokens
    span = BLOCK_SIZE * shard.world
    for req in range(len(query_start_loc) - 1):
        for t in range(query_start_loc[req], query_start_loc[req + 1]):
            offset = positions[t] % span
            if (offset // shard.interleave) % shard.world == shard.rank:
                local = offset // (shard.world * shard.interleave) * shard.interleave + offset % shard.interleave
                slots[t] = int(table[req, positions[t] // span]) * BLOCK_SIZE + local
    return slots


@pytest.mark.parametrize(("world", "interleave"), [(2, 1), (2, 2), (4, 1), (4, 8)])
def test_split_slot_mapping_is_vllms_layout(world: int, interleave: int) -> None:
    gen = torch.Generator().manual_seed(world * 10 + interleave)
    lens, starts = [5, 1, 17, 3, 40], [30, 64, 0, 100, 7]
    query_start_loc = [0]
    for n in lens:
        query_start_loc.append(query_start_loc[-1] + n)
    positions = [p for s, n in zip(starts, lens, strict=True) for p in range(s, s + n)]
    table = torch.randperm(400, generator=gen)[: 7 * 12].view(7, 12).int() + 1
    max_tokens = len(positions) + 5
    owners: dict[tuple[int, int], int] = {}
    held = 0
    for rank in range(world):
        shard = DcpShard(world, rank, interleave)
        got = torch.full((max_tokens,), 77, dtype=torch.int64)
        split_slot_mapping(
            torch.tensor(query_start_loc, dtype=torch.int32), torch.tensor(positions), table, got,
            num_tokens=len(positions), max_num_tokens=max_tokens, block_size=BLOCK_SIZE, shard=shard,
        )  # fmt: skip
        assert got.tolist() == kernel_transcription(query_start_loc, positions, table, max_tokens, shard)
        mine = got[got >= 0].tolist()
        assert len(mine) == len(set(mine)), "two positions of one rank in one row"
        held += len(mine)
        for t, slot in enumerate(got[: len(positions)].tolist()):
            if slot >= 0:
                owners[(next(r for r in range(len(lens)) if query_start_loc[r + 1] > t), positions[t])] = rank
    assert len(owners) == held == len(positions), "a position no rank holds, or two ranks hold"
    assert world == 1 or len(set(owners.values())) == world, "a rank that holds nothing"
