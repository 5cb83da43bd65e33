"""vLLM draft-model classes of dflash2 (imported by vLLM when it builds a drafter, never by register()).

`DFlashColumnParallelFcForCausalLM` is stock's `DFlashQwen3ForCausalLM` whose `fc` is a
`ColumnParallelLinear` with gathered output at tensor parallelism > 1 (K17, `dflash2.tp_fc`); at
TP=1 it is stock's drafter unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import ColumnParallelLinear
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model
from vllm.model_executor.models.utils import maybe_prefix

from dflash2.tp_fc import check_divisible

logger = logging.getLogger("vllm.plugins.dflash2")


class DFlashColumnParallelFcModel(DFlashQwen3Model):
    def __init__(self, *, vllm_config: Any, start_layer_id: int = 0, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, start_layer_id=start_layer_id, prefix=prefix)
        tp_size = get_tensor_model_parallel_world_size()
        if not self.use_aux_hidden_state or tp_size == 1:
            return
        replicated = self.fc
        check_divisible(replicated.output_size, tp_size)
        # stock annotates fc as ReplicatedLinear; both are LinearBase with the same call signature
        self.fc = ColumnParallelLinear(  # type: ignore[assignment]
            input_size=replicated.input_size,
            output_size=replicated.output_size,
            bias=False,
            gather_output=True,
            params_dtype=vllm_config.model_config.dtype,
            quant_config=self.quant_config,
            prefix=maybe_prefix(prefix, "fc"),
            return_bias=False,
        )
        del replicated
        logger.info(
            "dflash2: DFlash fc [%d -> %d] column-parallel over %d ranks, output gathered",
            self.fc.input_size,
            self.fc.output_size,
            tp_size,
        )


class DFlashColumnParallelFcForCausalLM(DFlashQwen3ForCausalLM):
    model_cls = DFlashColumnParallelFcModel
