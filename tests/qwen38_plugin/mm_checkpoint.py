"""Tiny Qwen4Exp multimodal checkpoint directories: `mm_checkpoint` *without weights*, for tests
of vLLM's multimodal configuration and processing (no model is built from it), and
`mm_model_checkpoint` with random weights (transformers' `Qwen4ExpForConditionalGeneration`), the
oracle of the engine and server tests.

`config.json` is transformers' `Qwen4ExpConfig` (`Qwen4ExpForConditionalGeneration`: the tiny
text model of `qwen38_plugin.tiny`, a tiny vision config with Flash-Next's patch geometry: patch
16, spatial merge 2, temporal patch 2), the real Qwen3.6 tokenizer, and the processor files
transformers writes for `Qwen3VLProcessor` (the processor transformers maps `qwen4_exp` to) with
Flash-Next's image budget (`size`: shortest_edge 65,536, longest_edge 16,777,216 pixels) and
normalization (mean and std 0.5 per channel, images and video).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from qwen38_plugin.tiny.checkpoints import tiny_config_dict
from qwen38_plugin.tiny.tokenizer import special_token_ids, write_tokenizer
from tests.conftest import building

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "tests" / "checkpoints"

IMAGE_SIZE = {"longest_edge": 16_777_216, "shortest_edge": 65_536}
# Qwen3-VL's normalization, which Flash-Next keeps (for images and video alike; transformers'
# Qwen2VLImageProcessor defaults to CLIP's).
NORMALIZE = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
}


def _write(out: Path, model_type: str, weights_seed: int | None = None) -> None:
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor
    from transformers import Qwen4ExpConfig as config_cls

    if model_type == "qwen3_8_flash_next":
        from qwen38_plugin.configs import Qwen3_8FlashNextConfig as config_cls  # type: ignore[assignment]
    elif model_type != "qwen4_exp":
        raise ValueError(f"model_type: {model_type!r}; use qwen4_exp or qwen3_8_flash_next")
    text = tiny_config_dict("qwen4_exp_text")
    # M-RoPE sections over the tiny model's 8 rotary frequencies (Flash-Next: [11, 11, 10] over 32),
    # interleaved as Qwen3.5's configs say: vLLM computes [3, T] positions only when the config
    # names them (transformers applies M-RoPE either way).
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [3, 3, 2], "mrope_interleaved": True}
    ids = special_token_ids()
    config = config_cls(
        text_config=text,
        vision_config={**VISION, "out_hidden_size": text["hidden_size"]},
        architectures=["Qwen4ExpForConditionalGeneration"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    config.save_pretrained(out)
    write_tokenizer(out, model_max_length=text["max_position_embeddings"])
    tokenizer = AutoTokenizer.from_pretrained(out)
    image_processor = Qwen2VLImageProcessor(
        size=IMAGE_SIZE, patch_size=16, merge_size=2, temporal_patch_size=2, **NORMALIZE
    )
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
        chat_template=tokenizer.chat_template,
    )
    processor.save_pretrained(out)
    if weights_seed is not None:
        _write_weights(out, weights_seed)


def _write_weights(out: Path, seed: int) -> None:
    """transformers' model of the config in `out`, every weight random (fp32)."""
    import torch
    from transformers import AutoConfig, Qwen4ExpForConditionalGeneration

    from qwen38_plugin.tiny.checkpoints import _randomize_zero_initialised

    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    model = Qwen4ExpForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # The vision tower at unit scale (HF's 0.02 would leave the merger's output to its biases,
        # the same for every patch): each image token's features depend on its pixels.
        for name, param in model.model.visual.named_parameters():
            if "norm" in name and name.endswith(".weight"):  # LayerNorm scales around 1
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif param.dim() >= 2:
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
            else:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
        # Logits far from uniform, so logprobs measure the model (HF's init gives logits of ~0.1).
        model.lm_head.weight.mul_(30.0)
    # HF starts norms, biases and the PLE convolution at zero: random values make every block count.
    _randomize_zero_initialised(model, generator)
    model.config.dtype = "float32"
    model.save_pretrained(out, safe_serialization=True)


def mm_model_checkpoint(seed: int = 0) -> Path:
    """A `qwen4_exp` multimodal checkpoint with random fp32 weights (built once per content)."""
    return mm_checkpoint("qwen4_exp", weights_seed=seed)


def mm_checkpoint(model_type: str = "qwen4_exp", weights_seed: int | None = None) -> Path:
    """The checkpoint directory, built once per content of this file and the tiny builders."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for module in ("checkpoints.py", "tokenizer.py", "chat_template.jinja"):
        digest.update((Path(tiny_config_dict.__code__.co_filename).parent / module).read_bytes())
    weights = "" if weights_seed is None else f"-weights{weights_seed}"
    out = CACHE / f"mm-{model_type}{weights}-{digest.hexdigest()[:16]}"
    with building(out):
        if not out.exists():
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            try:
                _write(staging, model_type, weights_seed)
                staging.rename(out)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
    return out
