"""The DFlash context projection `fc` column-parallel with its output gathered (karmic-kraken K17).

`fc` maps the target's concatenated auxiliary hidden states to the drafter's hidden size
(``[tokens, n_aux * H_target] -> [tokens, H_draft]``). Stock vLLM builds it as a `ReplicatedLinear`
(`qwen3_dflash.py`), so at tensor parallelism every rank reads the whole weight at every step.
As a `ColumnParallelLinear` with ``gather_output=True`` each rank holds and reads ``1/tp`` of the
output rows, computes each of its outputs with the full dot product, and the all-gather puts the
columns side by side: the result is the replicated one, bit for bit (the reduction of each
output element is unchanged; only which rank computes it moves).

This module holds the math (`column_shards`, `gathered_linear`) and the drafter classes that use
it inside vLLM (`DFlashColumnParallelFcModel`, `DFlashColumnParallelFcForCausalLM`), registered by
`dflash2.register()` under stock's `DFlashDraftModel` architecture; at TP=1 they are stock's.
"""

from __future__ import annotations

import torch


class ShardingError(ValueError):
    """`fc` cannot be split over the tensor-parallel ranks; names the sizes and the fix."""


def check_divisible(output_size: int, tp_size: int) -> None:
    if tp_size < 1 or output_size % tp_size:
        raise ShardingError(
            f"DFlash fc: the drafter's hidden_size {output_size} does not divide by "
            f"tensor_parallel_size={tp_size}; use a tensor-parallel size that divides it"
        )


def column_shards(weight: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """Rank r's rows of ``weight`` [out, in]: ``out / tp`` consecutive output features."""
    check_divisible(weight.shape[0], tp_size)
    return list(weight.chunk(tp_size, dim=0))


def gathered_linear(x: torch.Tensor, shards: list[torch.Tensor]) -> torch.Tensor:
    """What the ranks compute and the all-gather assembles: each rank ``x @ W_r^T``, concatenated."""
    return torch.cat([torch.nn.functional.linear(x, w) for w in shards], dim=-1)
