"""The K/V slot mapping of a decode-context-parallel rank on CPU (`cpu_context_parallel`), against a
per-token transcription of vLLM's CUDA kernel (`ComputeSlotMappingKernel.kernel` in
vllm/v1/worker/block_table.py), and the split it makes: every position on exactly one rank, no
two positions of a rank in one row. The engine it serves: test_qwen38_tp_engine.py (DCP 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qwen38_plugin.cpu_context_parallel import KERNEL, split_slot_mapping
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


def _in_a_fresh_process(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)


def test_install_replaces_the_cpu_platforms_slot_mapping_and_fails_loudly_without_it() -> None:
    # In a fresh process: before vLLM registered its CPU override (a worker does it right after loading
    # plugins) there is nothing to extend, and install() says so, naming the kernel; after it, ours
    # takes its place in vLLM's registry and a one-rank call still reaches the platform's function.
    before = _in_a_fresh_process("from qwen38_plugin import cpu_context_parallel as c; c.install()")
    assert before.returncode != 0
    assert f"needs vLLM's CPU override of {KERNEL}" in before.stderr, before.stderr[-2000:]
    after = _in_a_fresh_process(
        "import torch\n"
        "from vllm.platforms import current_platform\n"
        "from vllm.triton_utils import dispatcher\n"
        "from qwen38_plugin import cpu_context_parallel as c\n"
        "current_platform.register_triton_kernel_overrides()\n"
        "print(c.install(), c.install(), dispatcher._registry[c.KERNEL][1].__qualname__)\n"
        "from vllm.v1.worker.block_table import ComputeSlotMappingKernel\n"
        "slots = torch.full((6,), 7, dtype=torch.int64)\n"
        "table = torch.tensor([[3, 5]], dtype=torch.int32)\n"
        "ComputeSlotMappingKernel.kernel(4, 6, torch.tensor([0, 4], dtype=torch.int32), torch.arange(2, 6),\n"
        "    table, 2, slots, 4)\n"
        "print(slots.tolist())\n"
    )
    assert after.returncode == 0, after.stderr[-3000:]
    lines = after.stdout.strip().splitlines()
    assert lines[-2] == "installed installed _with_context_parallelism.<locals>.compute_slot_mapping", lines
    # positions 2-5 at rows 2-3 of block 3 and 0-1 of block 5; the rows past the step untouched: the
    # platform's function ran (the split mapping pads them with -1)
    assert lines[-1] == "[14, 15, 20, 21, 7, 7]", lines
