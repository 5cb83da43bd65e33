"""Run as a script: vLLM's ReplicatedLinear vs ColumnParallelLinear(gather_output=True) on 2 CPU ranks.

Usage: tp_fc_ranks.py PORT. Spawns two processes in a gloo group with vLLM's tensor-parallel state,
builds both layers from the same full weight through their own weight loaders, and prints one JSON
line per rank: {"rank", "cases": [{"dtype", "tokens", "in", "out", "equal", "local_rows"}]}.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.multiprocessing as mp

CASES = [
    (torch.float32, 1),
    (torch.float32, 129),
    (torch.bfloat16, 1),
    (torch.bfloat16, 37),
    (torch.bfloat16, 129),
    (torch.float16, 129),
]
IN_FEATURES, OUT_FEATURES = 5 * 256, 256  # five auxiliary hidden states of a 256-wide target


def rank_main(rank: int, world: int, port: int, queue: Any) -> None:
    import os

    os.environ["VLLM_DIST_IDENT"] = str(port)  # what vLLM's CPU worker sets: names the ranks' shared memory
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
        initialize_model_parallel(tensor_model_parallel_size=world)
        cases = []
        for dtype, tokens in CASES:
            gen = torch.Generator().manual_seed(tokens)
            weight = (torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen) * 0.03).to(dtype)
            x = torch.randn(tokens, IN_FEATURES, generator=gen).to(dtype)  # the same on every rank
            replicated = ReplicatedLinear(IN_FEATURES, OUT_FEATURES, bias=False, params_dtype=dtype, return_bias=False)
            column = ColumnParallelLinear(
                IN_FEATURES, OUT_FEATURES, bias=False, gather_output=True, params_dtype=dtype, return_bias=False
            )
            replicated.weight_loader(replicated.weight, weight)
            column.weight_loader(column.weight, weight)
            local_rows = column.weight.shape[0]
            own = torch.equal(column.weight, weight.chunk(world, dim=0)[rank])
            for layer in (replicated, column):
                layer.quant_method.process_weights_after_loading(layer)  # CPU: vLLM packs for its GEMM
            a, b = replicated(x), column(x)
            cases.append(
                {
                    "dtype": str(dtype),
                    "tokens": tokens,
                    "equal": bool(torch.equal(a, b)),
                    "local_rows": local_rows,
                    "own_rows": bool(own),
                }
            )
        queue.put(json.dumps({"rank": rank, "cases": cases}))


def main() -> None:
    port = int(sys.argv[1])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    lines = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
