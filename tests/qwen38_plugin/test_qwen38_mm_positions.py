"""The M-RoPE positions vLLM computes for a Qwen4Exp prompt with images and a video (Qwen3-VL's
`get_mrope_input_positions`, which stock's `Qwen4ExpForConditionalGeneration` inherits) equal
transformers' `Qwen4ExpModel.get_rope_index` for the same token ids and grids: the portable
multimodal model can keep stock's (issue 13 item 1).

The prompt goes through stock's multimodal processor for the architecture (placeholders expanded,
video timestamps inserted) on a tiny `Qwen4ExpForConditionalGeneration` checkpoint with the real
tokenizer; no engine.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.qwen38_plugin.mm_checkpoint import mm_checkpoint


@pytest.fixture(scope="module")
def processed() -> dict[str, Any]:
    from PIL import Image
    from vllm.engine.arg_utils import EngineArgs
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    vllm_config = EngineArgs(model=str(mm_checkpoint("qwen4_exp")), max_model_len=4096).create_engine_config()
    processor = MULTIMODAL_REGISTRY.create_processor(vllm_config.model_config)
    tokenizer = processor.info.get_tokenizer()
    prompt = tokenizer.encode(
        "Compare <|vision_start|><|image_pad|><|vision_end|> with <|vision_start|><|image_pad|><|vision_end|>"
        " and the clip <|vision_start|><|video_pad|><|vision_end|> please."
    )
    rng = np.random.default_rng(0)
    images = [Image.new("RGB", (200, 120), (200, 40, 90)), Image.new("RGB", (96, 300), (10, 140, 60))]
    frames = rng.integers(0, 255, (8, 96, 128, 3), dtype=np.uint8)
    metadata = {"fps": 4.0, "duration": 2.0, "total_num_frames": 8, "frames_indices": list(range(8)),
                "video_backend": "opencv", "do_sample_frames": False}  # fmt: skip
    items = processor.info.parse_mm_data({"image": images, "video": [(frames, metadata)]})
    out = processor.apply(ProcessorInputs(prompt, items), TimingContext())
    return {"out": out, "config": vllm_config.model_config.hf_config}


def test_vllm_mrope_positions_equal_transformers_rope_index(processed: dict[str, Any]) -> None:
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpModel
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration
    from vllm.multimodal.inputs import MultiModalFeatureSpec

    out, config = processed["out"], processed["config"]
    tokens: list[int] = out["prompt_token_ids"]
    features = [
        MultiModalFeatureSpec(data=item, modality=modality, identifier=f"{modality}{i}", mm_position=place)
        for modality in ("image", "video")
        for i, (item, place) in enumerate(
            zip(out["mm_kwargs"][modality], out["mm_placeholders"][modality], strict=True)
        )
    ]
    features.sort(key=lambda f: f.mm_position.offset)
    ours, delta = Qwen3VLForConditionalGeneration._get_mrope_input_positions(tokens, features, config)

    image_grid = torch.cat([item["image_grid_thw"].data.view(1, 3) for item in out["mm_kwargs"]["image"]])
    video_grid = torch.cat([item["video_grid_thw"].data.view(1, 3) for item in out["mm_kwargs"]["video"]])
    assert int(video_grid[0, 0]) > 1  # several temporal steps, each its own grid in transformers
    ids = torch.tensor(tokens)
    kinds = torch.zeros_like(ids)
    kinds[ids == config.image_token_id] = 1
    kinds[ids == config.video_token_id] = 2
    owner = SimpleNamespace(config=config, get_vision_position_ids=partial(Qwen4ExpModel.get_vision_position_ids, None))
    theirs, their_delta = Qwen4ExpModel.get_rope_index(owner, ids[None], kinds[None], image_grid, video_grid)  # type: ignore[arg-type]

    assert torch.equal(torch.as_tensor(ours).long(), theirs[:, 0].long())
    assert delta == int(their_delta)
    # the images and the video do give H and W rows of their own
    assert not torch.equal(theirs[1, 0], theirs[0, 0]) and not torch.equal(theirs[2, 0], theirs[0, 0])
