"""dflash2.tp_fc (K17): the column-parallel `fc` with gathered output is the replicated one, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash2.tp_fc import ShardingError, column_shards, gathered_linear

HERE = Path(__file__).resolve().parent


def simulated(dtype: torch.dtype, tp: int, tokens: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(replicated output, gathered column-parallel output) of a 2560 -> 512 fc."""
    gen = torch.Generator().manual_seed(tp * 1000 + tokens)
    weight = (torch.randn(512, 5 * 512, generator=gen) * 0.02).to(dtype).to(device)
    x = torch.randn(tokens, 5 * 512, generator=gen).to(dtype).to(device)
    shards = column_shards(weight, tp)
    assert all(s.shape == (512 // tp, 5 * 512) for s in shards)  # each rank holds 1/tp of the weight
    return torch.nn.functional.linear(x, weight), gathered_linear(x, shards)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tp", [2, 4])
def test_simulated_ranks_give_the_replicated_output_bit_for_bit(dtype: torch.dtype, tp: int) -> None:
    for tokens in (1, 8, 129):
        replicated, gathered = simulated(dtype, tp, tokens)
        if dtype != torch.float16 and tokens > 8:
            # Plain torch's bf16 and fp32 GEMMs on CPU (oneDNN, MKL) may change their reduction with
            # the output width for prefill-sized inputs, depending on the CPU (fp32 at TP=4 differed
            # on one CI machine, not on others), so bits can differ here; vLLM's own CPU GEMM does not
            # (test_vllm_layers_on_two_ranks_are_bit_identical, 129 tokens in bf16).
            rtol, atol = (1.6e-2, 1e-2) if dtype == torch.bfloat16 else (1e-5, 1e-5)
            torch.testing.assert_close(gathered, replicated, rtol=rtol, atol=atol)
        else:
            assert torch.equal(gathered, replicated), (tokens, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuBLAS); run on the GPU machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_simulated_ranks_on_cuda_are_bit_identical(dtype: torch.dtype) -> None:
    for tp in (2, 4):
        for tokens in (1, 8, 129, 1024):
            replicated, gathered = simulated(dtype, tp, tokens, device="cuda")
            assert torch.equal(gathered, replicated), (tp, tokens, dtype)


def test_a_hidden_size_the_ranks_cannot_split_is_refused() -> None:
    with pytest.raises(ShardingError, match="hidden_size 100 does not divide by tensor_parallel_size=3"):
        column_shards(torch.zeros(100, 10), 3)


def test_vllm_layers_on_two_ranks_are_bit_identical() -> None:
    """vLLM's own ReplicatedLinear and ColumnParallelLinear(gather_output=True), two gloo ranks on CPU."""
    from tools.vllm_server import free_port

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, str(HERE / "tp_fc_ranks.py"), str(free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for rank in ranks:
        assert len(rank["cases"]) == 6
        for case in rank["cases"]:
            assert case["equal"], (rank["rank"], case)
            assert case["local_rows"] == 128 and case["own_rows"], case  # half of the 256 output rows
