"""The class registered as `Qwen4ExpForConditionalGeneration`: stock vLLM's, whose encoder outputs
own their memory (`qwen38_plugin.encoder_outputs`, issue 13 item 5).

A subclass of stock's class (the nvidia or amd one, as stock's package picks per platform) that
only overrides `embed_multimodal`; everything else, the multimodal processor registered on stock's
class included, is inherited. It is what vLLM builds where stock's model runs (CUDA >= 8.0 or
ROCm, bf16); the portable model for other hardware is issue 13 item 1.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.models.qwen4_exp import Qwen4ExpForConditionalGeneration as _StockQwen4ExpForConditionalGeneration

from qwen38_plugin.encoder_outputs import own_memory


class Qwen4ExpForConditionalGeneration(_StockQwen4ExpForConditionalGeneration):
    """Stock's Qwen4ExpForConditionalGeneration; each encoder output owns its memory."""

    is_qwen38_owned_encoder_outputs = True

    def embed_multimodal(self, **kwargs: object) -> Any:
        outputs = super().embed_multimodal(**kwargs)
        if outputs is None or isinstance(outputs, torch.Tensor) or len(outputs) == 0:
            return outputs  # nothing, or one batched tensor that owns its storage
        return own_memory(outputs)
