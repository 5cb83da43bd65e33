"""Images, videos and prompts for the multimodal engine and server tests, made from seeds so the
test process (transformers' side) and the engine process (vLLM's side) build the same pixels.

A request is a JSON-able dict: ``text`` with ``<|vision_start|><|image_pad|><|vision_end|>`` /
``...<|video_pad|>...`` placeholders in order, ``images`` ``[[width, height, seed], ...]``,
``video`` ``[frames, height, width, seed]`` or None, ``max_tokens``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
VIDEO_FPS = 2.0


def make_image(width: int, height: int, seed: int) -> Any:
    """A noise image with a smooth gradient on top (RGB)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    ramp = np.linspace(0, 96, width, dtype=np.float64)[None, :, None]
    return Image.fromarray(np.clip(pixels * 0.6 + ramp, 0, 255).astype(np.uint8))


def make_frames(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    """``[frames, height, width, 3]`` uint8: one noise image drifting to the right, frame by frame."""
    base = np.asarray(make_image(width + 4 * frames, height, seed))
    return np.stack([base[:, 4 * i : 4 * i + width] for i in range(frames)])


def video_metadata(frames: int) -> dict[str, Any]:
    """What vLLM's video loader reports for a clip whose every frame is kept (no resampling)."""
    return {"fps": VIDEO_FPS, "duration": frames / VIDEO_FPS, "total_num_frames": frames,
            "frames_indices": list(range(frames)), "video_backend": "opencv", "do_sample_frames": False}  # fmt: skip


def vllm_prompt(request: dict[str, Any]) -> dict[str, Any]:
    """The request as `vllm.LLM.generate` takes it (text prompt and multi_modal_data)."""
    data: dict[str, Any] = {}
    if request.get("images"):
        data["image"] = [make_image(*spec) for spec in request["images"]]
    if request.get("video"):
        frames = request["video"][0]
        data["video"] = [(make_frames(*request["video"]), video_metadata(frames))]
    return {"prompt": request["text"], "multi_modal_data": data}


def hf_inputs(processor: Any, request: dict[str, Any]) -> dict[str, torch.Tensor]:
    """transformers' processor outputs for the request (the same frames, none resampled)."""
    images = [make_image(*spec) for spec in request.get("images") or []]
    videos = []
    if request.get("video"):
        videos = [(make_frames(*request["video"]), video_metadata(request["video"][0]))]
    return hf_process(processor, request["text"], images, videos)


def hf_process(
    processor: Any, text: str, images: list[Any], videos: list[tuple[np.ndarray, dict[str, Any]]]
) -> dict[str, torch.Tensor]:
    """transformers' processor on `text` with its media: each video as vLLM's loader hands it over
    (frames and metadata). A clip whose every frame was decoded (``do_sample_frames`` true in the
    loader's metadata) is sampled by the processor at its own rate, as vLLM's processor does;
    frames a loader already picked are taken as they are."""
    from transformers.video_utils import VideoMetadata

    kwargs: dict[str, Any] = {}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = [frames for frames, _ in videos]
        kwargs["video_metadata"] = [
            VideoMetadata(total_num_frames=meta["total_num_frames"], fps=meta["fps"], duration=meta["duration"],
                          frames_indices=list(meta["frames_indices"]), video_backend="opencv")
            for _, meta in videos
        ]  # fmt: skip
        sample = {bool(meta.get("do_sample_frames", False)) for _, meta in videos}
        assert len(sample) == 1, "one call samples all videos or none"
        kwargs["do_sample_frames"] = sample.pop()
    return dict(processor(text=[text], return_tensors="pt", **kwargs))


def hf_reference(path: Path, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`hf_run` on each request alone."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = load_hf_model(path)
    return [hf_run(model, hf_inputs(processor, request), request["max_tokens"]) for request in requests]


def load_hf_model(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    from transformers import Qwen4ExpForConditionalGeneration

    return Qwen4ExpForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device).eval()


def hf_run(model: Any, inputs: dict[str, torch.Tensor], max_tokens: int) -> dict[str, Any]:
    """transformers' `Qwen4ExpForConditionalGeneration` (fp32 on CPU in the tests; any dtype and
    device the model has) on one prompt: its ids, the logprob of every prompt token
    (`prompt_logprobs`, None for the first), and greedy decoding without a cache (every step a full
    forward over prompt and media: a cold run), with the logprob of each chosen token and the
    margin between the top two logprobs at each step (`margins`)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    inputs = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in inputs.items()}
    with torch.no_grad():
        ids = inputs["input_ids"]
        logprobs = torch.log_softmax(model(**inputs).logits[0].float(), -1)
        prompt_logprobs = [None] + [float(logprobs[i, ids[0, i + 1]]) for i in range(ids.shape[1] - 1)]
        tokens, token_logprobs, margins = [], [], []
        step_logprobs = logprobs[-1]
        for _ in range(max_tokens):
            top = step_logprobs.topk(2).values
            margins.append(float(top[0] - top[1]))
            token = int(step_logprobs.argmax())
            tokens.append(token)
            token_logprobs.append(float(step_logprobs[token]))
            inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[token]], device=device)], 1)
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
            types = inputs["mm_token_type_ids"]
            inputs["mm_token_type_ids"] = torch.cat([types, torch.zeros((1, 1), dtype=types.dtype, device=device)], 1)
            step_logprobs = torch.log_softmax(model(**inputs).logits[0, -1].float(), -1)
    return {"prompt_token_ids": ids[0].tolist(), "prompt_logprobs": prompt_logprobs, "tokens": tokens,
            "logprobs": token_logprobs, "margins": margins}  # fmt: skip
