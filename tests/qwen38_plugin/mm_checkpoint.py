"""A tiny Qwen4Exp multimodal checkpoint *directory without weights*, for tests of vLLM's
multimodal configuration and processing (no model is built from it).

`config.json` is transformers' `Qwen4ExpConfig` (`Qwen4ExpForConditionalGeneration`: the tiny
text model of `qwen38_plugin.tiny`, a tiny vision config with Flash-Next's patch geometry: patch
16, spatial merge 2, temporal patch 2), the real Qwen3.6 tokenizer, and the processor files
transformers writes for `Qwen3VLProcessor` (the processor transformers maps `qwen4_exp` to) with
Flash-Next's image budget (`size`: shortest_edge 65,536, longest_edge 16,777,216 pixels).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from qwen38_plugin.tiny.checkpoints import tiny_config_dict
from qwen38_plugin.tiny.tokenizer import special_token_ids, write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "tests" / "checkpoints"

IMAGE_SIZE = {"longest_edge": 16_777_216, "shortest_edge": 65_536}
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


def _write(out: Path, model_type: str) -> None:
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor
    from transformers import Qwen4ExpConfig as config_cls

    if model_type == "qwen3_8_flash_next":
        from qwen38_plugin.configs import Qwen3_8FlashNextConfig as config_cls  # type: ignore[assignment]
    elif model_type != "qwen4_exp":
        raise ValueError(f"model_type: {model_type!r}; use qwen4_exp or qwen3_8_flash_next")
    text = tiny_config_dict("qwen4_exp_text")
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
    image_processor = Qwen2VLImageProcessor(size=IMAGE_SIZE, patch_size=16, merge_size=2, temporal_patch_size=2)
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
        chat_template=tokenizer.chat_template,
    )
    processor.save_pretrained(out)


def mm_checkpoint(model_type: str = "qwen4_exp") -> Path:
    """The checkpoint directory, built once per content of this file and the tiny builders."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for module in ("checkpoints.py", "tokenizer.py", "chat_template.jinja"):
        digest.update((Path(tiny_config_dict.__code__.co_filename).parent / module).read_bytes())
    out = CACHE / f"mm-{model_type}-{digest.hexdigest()[:16]}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            _write(staging, model_type)
            staging.rename(out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return out
