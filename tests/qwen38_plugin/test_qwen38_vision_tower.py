"""vLLM's Qwen3-VL vision tower (`qwen3_vl.Qwen3_VisionTransformer`, what stock's
`Qwen4ExpForConditionalGeneration` builds) against transformers' `Qwen4ExpVisionModel` on CPU in
fp32: the basis of the portable `Qwen4ExpForConditionalGeneration` (issue 13 item 1).

A tiny random `Qwen4ExpVisionModel` (every weight drawn at random, biases and norms included) is
loaded into vLLM's tower through its own `load_weights`; both run the same patches of an image and
a two-frame video in one batch (packed sequences, vLLM's CPU vision attention backend), and the
merged features (the patch merger's output, what the language model receives) agree within 1e-4
relative error (measured 1e-6). No vLLM engine: the tower is built in this process from vLLM's layers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def _tiny_vision_config(**overrides: Any) -> Any:
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig

    fields: dict[str, Any] = {
        "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 96, "num_position_embeddings": 64,
    }  # fmt: skip
    fields.update(overrides)
    return Qwen4ExpVisionConfig(**fields)


def _randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.05
            is_norm_scale = "norm" in name and name.endswith(".weight")  # LayerNorm scales around 1
            param.copy_(1.0 + noise if is_norm_scale else noise)
    return model.eval()


@pytest.mark.parametrize("hidden_act", ["gelu_pytorch_tanh", "silu"])
def test_vllm_qwen3_vl_tower_equals_transformers_qwen4exp_vision(vllm_single_rank: None, hidden_act: str) -> None:
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    config = _tiny_vision_config(hidden_act=hidden_act)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = _randomized(Qwen4ExpVisionModel(config), seed=1)
    with set_current_vllm_config(VllmConfig()):
        ours = Qwen3_VisionTransformer(config, norm_eps=1e-6, prefix="visual")
    loaded = ours.load_weights((name, tensor.clone()) for name, tensor in theirs.state_dict().items())
    assert loaded == {name for name, _ in ours.named_parameters()}
    # what vLLM's loader does after loading (`process_weights_after_loading`'s loop): on CPU each
    # linear layer prepacks its weight for oneDNN
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    for module in ours.modules():
        quant_method = getattr(module, "quant_method", None)
        if isinstance(quant_method, QuantizeMethodBase):
            quant_method.process_weights_after_loading(module)
    ours.eval()
    # vLLM's tower fixes the vision RoPE base at 10,000 (it does not read the config's): the
    # transformers default, which the portable model has to check a checkpoint keeps
    assert ours.rotary_pos_emb.base == config.rope_parameters["rope_theta"] == 10_000.0
    assert ours.attn_backend.name == "TORCH_SDPA"  # vLLM's vision attention backend on CPU

    # an image of 8 x 12 patches and a two-frame video of 4 x 6 patches, packed in one batch
    grid_thw = torch.tensor([[1, 8, 12], [2, 4, 6]])
    patches = int(grid_thw.prod(-1).sum())
    patch_values = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.randn(patches, patch_values, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = theirs(pixels, grid_thw).pooler_output
        got = ours(pixels, grid_thw.tolist())
    merged = patches // config.spatial_merge_size**2
    assert want.shape == got.shape == (merged, config.out_hidden_size)
    error = float((got - want).norm() / want.norm())
    assert error <= 1e-4, error
