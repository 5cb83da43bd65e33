"""The K/V slot mapping of a decode-context-parallel rank on CPU (`cpu_context_parallel`), against a
per-token transcription of vLLM's CUDA kernel (`ComputeSlotMappingKernel.kernel` in
vllm/v1/worker/block_table.py), and the split it makes: every position on exactly one rank, no
two positions of a rank in one row; the speculative proposer's draft-step mapping the same way,
against vLLM's own CPU function for what does not depend on the rank. The engines they serve:
test_qwen38_tp_engine.py (DCP 2) and test_qwen38_mtp_drafts_engine.py (MTP beside DCP 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qwen38_plugin.cpu_context_parallel import KERNEL, draft_step_slot_mapping, split_slot_mapping
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


@pytest.mark.parametrize(("world", "interleave"), [(2, 1), (2, 2), (4, 1)])
def test_draft_step_slot_mapping_splits_vllms_draft_step(world: int, interleave: int) -> None:
    import vllm._custom_ops  # noqa: F401  (loads the CPU build's C++ ops)
    from vllm.utils.cpu_triton_utils import _eagle_step_slot_mapping_metadata_kernel_impl as stock

    max_model_len, padded = 64, 8
    positions = torch.tensor([3, 10, 15, 31, 40, 62, 63])  # the last steps past max_model_len
    gen = torch.Generator().manual_seed(world + interleave)
    table = (torch.randperm(90, generator=gen)[: 7 * 4].view(7, 4) + 1).int()
    seq_lens = (positions + 1).int()
    # vLLM's own CPU function: the next positions (clamped) and sequence lengths, unsplit slots
    clamped, slots = torch.zeros(7, dtype=torch.int64), torch.full((padded,), 9, dtype=torch.int64)
    stock_lens = seq_lens.clone()
    stock(positions, table, 4, stock_lens, clamped, slots, BLOCK_SIZE * world, max_model_len, 4, -1, 7)
    assert clamped.tolist() == [4, 11, 16, 32, 41, 63, 0] and slots[6:].tolist() == [-1, -1]
    held = []
    for rank in range(world):
        shard = DcpShard(world, rank, interleave)
        got_clamped, got_slots = torch.zeros(7, dtype=torch.int64), torch.full((padded,), 9, dtype=torch.int64)
        got_lens = seq_lens.clone()
        draft_step_slot_mapping(
            positions, table, got_lens, got_clamped, got_slots, block_size=BLOCK_SIZE, max_model_len=max_model_len,
            shard=shard,
        )  # fmt: skip
        assert got_clamped.tolist() == clamped.tolist() and got_lens.tolist() == stock_lens.tolist()
        # the clamped positions of the steps that stay inside the model length, as a one-token step each
        expected = kernel_transcription(list(range(8)), [*clamped.tolist(), 0], table, 8, shard)
        expected[6:] = [-1, -1]  # past max_model_len, and the padding row
        assert got_slots.tolist() == expected
        held += [t for t, slot in enumerate(got_slots.tolist()) if slot >= 0]
    assert sorted(held) == list(range(6)), "a next position no rank holds, or two ranks hold"


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


def test_install_with_a_shard_replaces_the_draft_step_mapping_and_fails_loudly_without_it() -> None:
    setup = (
        "from vllm.platforms import current_platform\n"
        "from vllm.triton_utils import dispatcher\n"
        "from qwen38_plugin import cpu_context_parallel as c\n"
        "from qwen38_plugin.ops.qsa_paged import DcpShard\n"
        "current_platform.register_triton_kernel_overrides()\n"
    )
    installed = _in_a_fresh_process(
        setup + "print(c.install(DcpShard(2, 1)), dispatcher._registry[c.DRAFT_STEP_KERNEL][1].__qualname__)\n"
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert installed.stdout.split()[-2:] == [
        "installed", "_draft_step_with_context_parallelism.<locals>.eagle_step_slot_mapping"
    ], installed.stdout  # fmt: skip
    renamed = _in_a_fresh_process(setup + "del dispatcher._registry[c.DRAFT_STEP_KERNEL]\nc.install(DcpShard(2, 0))\n")
    assert renamed.returncode != 0
    assert "needs vLLM's CPU override of vllm.v1.spec_decode.utils.eagle_step" in renamed.stderr, renamed.stderr[-2000:]
