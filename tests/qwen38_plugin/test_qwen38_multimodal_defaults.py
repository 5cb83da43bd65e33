"""Issue 13 items 2-4: ReVolta 0.1.2's multimodal defaults for Qwen4Exp multimodal checkpoints.

The rules are plain functions (`qwen38_plugin.multimodal_defaults`); inside vLLM they run from
the architecture's config hook (`qwen38_plugin.vllm_multimodal`). These tests check the rules,
then the outcomes through stock vLLM's own objects, without starting an engine: the config
`EngineArgs(...).create_engine_config()` resolves, stock's multimodal processor on a 977 x 1073
image, the encoder budget vLLM's start-up profile computes, stock's chat parser counting images
over messages and loading a video made here.
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from qwen38_plugin import multimodal_defaults as mmd
from qwen38_plugin import vllm_multimodal
from tests.qwen38_plugin.mm_checkpoint import mm_checkpoint

IMAGE_TOKEN = "<|image_pad|>"
ARCH = "Qwen4ExpForConditionalGeneration"
UNIFORM_16 = {"video_backend": "opencv", "num_frames": 16}
RESTORE = {"images_kwargs": {"size": {"longest_edge": 16_777_216, "shortest_edge": 65_536}}}


# ---------------------------------------------------------------- the rules, as plain functions


def test_limits_default_and_each_named_modality_overrides() -> None:
    assert mmd.resolve_limits({}) == {"image": 8, "video": 1, "audio": 1}
    assert mmd.resolve_limits({"image": 2}) == {"image": 2, "video": 1, "audio": 1}
    assert mmd.resolve_limits({"video": 0, "image": 16}) == {"image": 16, "video": 0, "audio": 1}
    # The SM70 platform applies its own default later: the user's limits are left as they are.
    assert mmd.resolve_limits({}, platform_owns_limits=True) == {}
    assert mmd.resolve_limits({"image": 3}, platform_owns_limits=True) == {"image": 3}


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True])
def test_bad_limit_names_the_option_and_the_fix(bad: object) -> None:
    with pytest.raises(mmd.MultimodalDefaultsError, match=r"--limit-mm-per-prompt: 'image' must be a whole number"):
        mmd.resolve_limits({"image": bad})  # type: ignore[dict-item]


def test_image_budget_is_added_unless_the_user_sized_images() -> None:
    assert mmd.resolve_mm_processor_kwargs({}) == {"images_kwargs": {"size": {"longest_edge": 1_048_576}}}
    # Other kwargs, flat or in images_kwargs, are kept beside the budget.
    assert mmd.resolve_mm_processor_kwargs({"fps": 1, "images_kwargs": {"do_convert_rgb": True}}) == {
        "fps": 1,
        "images_kwargs": {"do_convert_rgb": True, "size": {"longest_edge": 1_048_576}},
    }
    for key, value in (("size", {"longest_edge": 4_000_000}), ("max_pixels", 4_000_000), ("min_pixels", 4096),
                       ("do_resize", False)):  # fmt: skip
        for explicit in ({key: value}, {"images_kwargs": {key: value}}):
            assert mmd.explicit_image_sizing(explicit)
            assert mmd.resolve_mm_processor_kwargs(explicit) == explicit, explicit
    assert mmd.resolve_mm_processor_kwargs(RESTORE) == RESTORE


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_pixels": -5}, r"max_pixels must be a whole number of pixels > 0, got -5"),
        ({"images_kwargs": {"size": {"longest_edge": 0}}}, r"images_kwargs.size.longest_edge must be .* got 0"),
        ({"images_kwargs": {"size": 1024}}, r"images_kwargs.size must be an object"),
        (
            {"min_pixels": 2_000_000, "max_pixels": 1_000_000},
            r"the minimum image area \(2000000 pixels\) exceeds the maximum \(1000000 pixels\).*lower min_pixels",
        ),
        ({"images_kwargs": {"do_resize": "no"}}, r"images_kwargs.do_resize must be true or false"),
        ({"images_kwargs": [1]}, r"images_kwargs must be an object"),
    ],
)
def test_bad_image_sizing_names_the_field_and_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(mmd.MultimodalDefaultsError, match="--mm-processor-kwargs: " + message):
        mmd.resolve_mm_processor_kwargs(kwargs)


def test_video_frames_default_to_16_unless_set() -> None:
    assert mmd.resolve_media_io_kwargs({}) == {"video": UNIFORM_16}
    assert mmd.resolve_media_io_kwargs({"video": {"fps": 2}, "image": {"a": 1}}) == {
        "video": {**UNIFORM_16, "fps": 2},
        "image": {"a": 1},
    }
    # An explicit count is honoured (by the uniform loader, which stock's qwen3_vl loader is not).
    assert mmd.resolve_media_io_kwargs({"video": {"num_frames": 40}}) == {
        "video": {"video_backend": "opencv", "num_frames": 40}
    }
    assert mmd.resolve_media_io_kwargs({"video": {"num_frames": -1}})["video"]["num_frames"] == -1
    # The user's own loader keeps its own sampling.
    assert mmd.resolve_media_io_kwargs({"video": {"video_backend": "qwen3_vl"}}) == {
        "video": {"video_backend": "qwen3_vl"}
    }
    for bad in (0, -2, 2.5, "16"):
        with pytest.raises(mmd.MultimodalDefaultsError, match=r"--media-io-kwargs: video\.num_frames must be"):
            mmd.resolve_media_io_kwargs({"video": {"num_frames": bad}})


def test_smart_resize_with_the_budget() -> None:
    """transformers' smart_resize (what stock's processor runs) with the two budgets: 977 x 1073."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    height, width = smart_resize(1073, 977, factor=32, min_pixels=65_536, max_pixels=mmd.IMAGE_MAX_PIXELS)
    assert (width, height) == (960, 1056)
    height, width = smart_resize(1073, 977, factor=32, min_pixels=65_536, max_pixels=mmd.CHECKPOINT_IMAGE_MAX_PIXELS)
    assert (width, height) == (992, 1088)  # stock's result with the checkpoint's budget
    assert mmd.IMAGE_MAX_PIXELS // 32**2 == 1024  # image tokens of a full-budget image


# ---------------------------------------------------------------- inside vLLM's own config objects


def engine_config(model: Path, **kwargs: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=4096, **kwargs).create_engine_config()


def counts(vllm_config: Any) -> dict[str, int]:
    return {m: o.count for m, o in vllm_config.model_config.multimodal_config.limit_per_prompt.items()}


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return mm_checkpoint("qwen4_exp")


@pytest.fixture(scope="module")
def default_config(checkpoint: Path) -> Any:
    return engine_config(checkpoint)


def test_stock_config_hook_is_wrapped_once() -> None:
    """Guard: stock's hook for the architecture is the one we wrap, and install() is idempotent."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    vllm_multimodal.install()
    hook = MODELS_CONFIG_MAP[ARCH]
    assert getattr(hook, vllm_multimodal.HOOK_MARKER)
    assert hook.wrapped.__name__ == "Qwen4ExpForConditionalGenerationConfig"  # stock's, still called first
    vllm_multimodal.install()
    assert MODELS_CONFIG_MAP[ARCH] is hook


def test_defaults_resolved_by_vllm_config(default_config: Any) -> None:
    mm = default_config.model_config.multimodal_config
    assert counts(default_config) == {"image": 8, "video": 1, "audio": 1}
    assert mm.get_limit_per_prompt("image") == 8 and mm.get_limit_per_prompt("video") == 1
    assert mm.mm_processor_kwargs == {"images_kwargs": {"size": {"longest_edge": 1_048_576}}}
    assert mm.media_io_kwargs == {"video": UNIFORM_16}


def test_explicit_options_keep_priority(checkpoint: Path) -> None:
    some = engine_config(checkpoint, limit_mm_per_prompt={"image": 2})
    assert counts(some) == {"image": 2, "video": 1, "audio": 1}
    rich = engine_config(
        checkpoint,
        limit_mm_per_prompt={"image": 16, "video": {"count": 2, "num_frames": 8}},
        mm_processor_kwargs=RESTORE,
        media_io_kwargs={"video": {"num_frames": 4}},
    )
    mm = rich.model_config.multimodal_config
    assert counts(rich) == {"image": 16, "video": 2, "audio": 1}
    assert mm.limit_per_prompt["video"].num_frames == 8  # the user's profiling options survive
    assert mm.mm_processor_kwargs == RESTORE
    assert mm.media_io_kwargs == {"video": {"video_backend": "opencv", "num_frames": 4}}


def test_bad_options_fail_at_startup_naming_the_field(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"--mm-processor-kwargs: images_kwargs.max_pixels must be a whole number"):
        engine_config(checkpoint, mm_processor_kwargs={"images_kwargs": {"max_pixels": -1}})
    with pytest.raises(ValueError, match=r"--media-io-kwargs: video.num_frames must be a whole number"):
        engine_config(checkpoint, media_io_kwargs={"video": {"num_frames": 0}})
    # A negative limit never reaches the hook: stock's MultiModalConfig refuses it, naming the field.
    with pytest.raises(ValueError, match=r"limit_per_prompt.count\s+Input should be greater than or equal to 0"):
        engine_config(checkpoint, limit_mm_per_prompt={"image": -1})


def test_alias_checkpoint_gets_the_same_defaults() -> None:
    alias = engine_config(mm_checkpoint("qwen3_8_flash_next"))
    assert type(alias.model_config.hf_config).model_type == "qwen3_8_flash_next"
    assert alias.model_config.architecture == ARCH
    assert counts(alias) == {"image": 8, "video": 1, "audio": 1}
    assert alias.model_config.multimodal_config.media_io_kwargs == {
        "video": {"video_backend": "opencv", "num_frames": 16}
    }
    assert image_tokens(alias.model_config, 977, 1073) == (990, [1, 66, 60])


# ---------------------------------------------------------------- stock's processor, profile and chat parser


def image_tokens(model_config: Any, width: int, height: int, **request_kwargs: Any) -> tuple[int, list[int]]:
    """Image placeholder tokens and (t, h, w) patch grid stock's processor gives one image."""
    from PIL import Image
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    processor = MULTIMODAL_REGISTRY.create_processor(model_config)
    tokenizer = processor.info.get_tokenizer()
    prompt = tokenizer.encode(f"<|vision_start|>{IMAGE_TOKEN}<|vision_end|>Describe.")
    items = processor.info.parse_mm_data({"image": [Image.new("RGB", (width, height), (200, 40, 90))]})
    out = processor.apply(ProcessorInputs(prompt, items, hf_processor_mm_kwargs=request_kwargs), TimingContext())
    grid = out["mm_kwargs"]["image"][0]["image_grid_thw"].data.tolist()
    return out["prompt_token_ids"].count(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)), grid


def test_large_image_resized_to_the_budget_by_stocks_processor(default_config: Any, checkpoint: Path) -> None:
    # 977 x 1073 (1,048,321 pixels) -> smart_resize -> 960 x 1056: 60 x 66 patches of 16, 990 tokens.
    assert image_tokens(default_config.model_config, 977, 1073) == (990, [1, 66, 60])
    # A much larger image is resized, not refused: at most 1,024 tokens.
    tokens, _ = image_tokens(default_config.model_config, 4000, 3000)
    assert tokens <= 1024
    # A request's own kwargs win over the server's budget (vLLM merges request over config).
    assert image_tokens(default_config.model_config, 977, 1073, max_pixels=16_777_216) == (1054, [1, 68, 62])
    assert (
        image_tokens(default_config.model_config, 977, 1073, images_kwargs={"size": {"longest_edge": 500_000}})[0] < 990
    )
    # The README's restore option gives stock's result: 992 x 1088, 1,054 tokens.
    restored = engine_config(checkpoint, mm_processor_kwargs=RESTORE)
    assert image_tokens(restored.model_config, 977, 1073) == (1054, [1, 68, 62])


def test_startup_profile_plans_for_1024_image_tokens(default_config: Any, checkpoint: Path) -> None:
    """The encoder budget vLLM's start-up memory profile uses (`MultiModalBudget`), both budgets."""
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    budget = MultiModalBudget(default_config, MULTIMODAL_REGISTRY, enable_cache=False)
    assert budget.mm_max_toks_per_item["image"] == 1024
    assert budget.processor.info.allowed_mm_limits == {"image": 8, "video": 1}
    restored = MultiModalBudget(engine_config(checkpoint, mm_processor_kwargs=RESTORE), MULTIMODAL_REGISTRY)
    assert restored.mm_max_toks_per_item["image"] == 16_384  # stock's, with the checkpoint's budget


def png_url(width: int = 40, height: int = 30) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def user(images: int, text: str = "What is this?") -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": png_url()}} for _ in range(images)]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def parse(model_config: Any, messages: list[dict[str, Any]]) -> Any:
    from vllm.renderers.chat_utils import parse_chat_messages

    return parse_chat_messages(messages, model_config, content_format="openai")  # type: ignore[arg-type]


def test_images_in_earlier_messages_count(default_config: Any, checkpoint: Path) -> None:
    """Stock's chat parser counts every message's images against the limit; 9 > 8 is refused."""
    from vllm.exceptions import VLLMValidationError

    assistant = {"role": "assistant", "content": "A square."}
    _, mm_data, _ = parse(default_config.model_config, [user(5), assistant, user(3)])
    assert len(mm_data["image"]) == 8
    with pytest.raises(VLLMValidationError, match=r"^At most 8 image\(s\) may be provided in one prompt\."):
        parse(default_config.model_config, [user(5), assistant, user(4)])
    raised = engine_config(checkpoint, limit_mm_per_prompt={"image": 9})
    _, mm_data, _ = parse(raised.model_config, [user(5), assistant, user(4)])
    assert len(mm_data["image"]) == 9


@pytest.fixture(scope="module")
def video_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 10-second MP4 of 40 frames at 4 fps; frame i is filled with grey level 6 * i."""
    import cv2
    import numpy as np

    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 4.0, (64, 48))
    for i in range(40):
        writer.write(np.full((48, 64, 3), 6 * i, dtype=np.uint8))
    writer.release()
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


def video_message(url: str, videos: int = 1) -> dict[str, Any]:
    parts = [{"type": "video_url", "video_url": {"url": url}} for _ in range(videos)]
    return {"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}


def loaded_video(model_config: Any, url: str) -> tuple[Any, dict[str, Any]]:
    _, mm_data, _ = parse(model_config, [video_message(url)])
    frames, metadata = mm_data["video"][0]
    return frames, metadata


def test_video_sampled_at_16_frames(default_config: Any, checkpoint: Path, video_url: str) -> None:
    """Stock's video loaders, through the chat parser, with the resolved media kwargs."""
    import numpy as np
    from vllm.exceptions import VLLMValidationError
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    frames, metadata = loaded_video(default_config.model_config, video_url)
    indices = np.linspace(0, 39, 16, dtype=int).tolist()  # evenly over the whole clip
    assert len(frames) == 16 and metadata["total_num_frames"] == 40 and metadata["frames_indices"] == indices
    # The frames decoded are those (frame i is grey 6 * i; lossy MPEG-4 shifts it by less than a step).
    assert np.all(np.abs(np.array([frame.mean() for frame in frames]) - 6 * np.array(indices)) < 6)
    # Stock's processor takes them: 16 frames in temporal patches of 2 -> a grid of 8 steps.
    processor = MULTIMODAL_REGISTRY.create_processor(default_config.model_config)
    prompt = processor.info.get_tokenizer().encode("<|vision_start|><|video_pad|><|vision_end|>")
    items = processor.info.parse_mm_data({"video": [(frames, metadata)]})
    out = processor.apply(ProcessorInputs(prompt, items), TimingContext())
    assert out["mm_kwargs"]["video"][0]["video_grid_thw"].data.tolist()[0] == 8
    # Stock's own choice for this processor (the qwen3_vl loader, 2 frames per second): 20 here.
    stock = engine_config(checkpoint, media_io_kwargs={"video": {"video_backend": "qwen3_vl"}})
    assert len(loaded_video(stock.model_config, video_url)[0]) == 20
    explicit = engine_config(checkpoint, media_io_kwargs={"video": {"num_frames": 8}})
    assert len(loaded_video(explicit.model_config, video_url)[0]) == 8
    with pytest.raises(VLLMValidationError, match=r"^At most 1 video\(s\) may be provided in one prompt"):
        parse(default_config.model_config, [video_message(video_url, videos=2)])


# ---------------------------------------------------------------- on SM70 the platform's default stays


class _Sm70Platform:
    """Stands in for sm70_backend's platform on a V100 (its CUDA platform cannot load on a CPU
    build; tests/sm70_backend/test_backend_registration.py checks the real class's method)."""

    @staticmethod
    def owns_multimodal_default(vllm_config: Any) -> bool:
        from sm70_backend.sm70_config import mm_default_applies

        return mm_default_applies(vllm_config)


def sm70_config(limits: dict[str, int], backend: str | None = None) -> Any:
    from vllm.config.multimodal import MultiModalConfig

    model_config = SimpleNamespace(
        architecture=ARCH,
        dtype=torch.float16,
        model="/nonexistent",
        hf_config=SimpleNamespace(dtype=torch.float16),
        multimodal_config=MultiModalConfig(limit_per_prompt=limits),  # type: ignore[arg-type]
    )
    return SimpleNamespace(model_config=model_config, attention_config=SimpleNamespace(backend=backend))


@pytest.fixture
def sm70_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="vllm.plugins"):
        yield caplog


def test_sm70_keeps_one_image_and_no_video(sm70_logs: pytest.LogCaptureFixture) -> None:
    """Both hooks in vLLM's order: the model's (ours), then the platform's (sm70_backend's)."""
    from sm70_backend.sm70_config import apply_quirks

    def both(limits: dict[str, int], backend: str | None = None) -> tuple[dict[str, int], Any]:
        config = sm70_config(limits, backend)
        vllm_multimodal.apply_multimodal_defaults(config, platform=_Sm70Platform)
        apply_quirks(config, (7, 0))
        return counts(config), config.model_config.multimodal_config

    limits, mm = both({})
    assert limits == {"image": 1, "video": 0}
    assert mm.mm_processor_kwargs == {"images_kwargs": {"size": {"longest_edge": 1_048_576}}}  # on V100 too
    assert mm.media_io_kwargs == {"video": UNIFORM_16}
    assert any("Using SM70 Flash-V100 multimodal default" in r.getMessage() for r in sm70_logs.records)
    assert any("limits: the platform's own multimodal default" in r.getMessage() for r in sm70_logs.records)
    assert both({"image": 4})[0] == {"image": 4, "video": 0}  # SM70's rule: no "video" named, no video
    assert both({"image": 8, "video": 1, "audio": 1})[0] == {"image": 8, "video": 1, "audio": 1}
    # Another attention backend on the V100: the generic default.
    assert both({}, backend="TRITON_ATTN")[0] == {"image": 8, "video": 1, "audio": 1}
