"""ReVolta 0.1.2's multimodal defaults for Qwen3.8 Flash-Next checkpoints, as plain functions.

Issue 13 items 2-4 (rows R15-R20 of the stock-vLLM matrix). Stock vLLM 0.32 already has the
machinery; what differs are its defaults, so these functions only fill in what the user left
unset, on vLLM's own settings (`qwen38_plugin.vllm_multimodal` applies them to the
`MultiModalConfig` from the architecture's config hook):

- limits (`--limit-mm-per-prompt`): stock allows 999 items of every modality; the default here
  is 8 images, 1 video and 1 audio item per request, and the option overrides each modality it
  names (the others keep this default). Stock counts the items of every message of a chat, so
  images in earlier messages count. On a V100 with FLASH_ATTN_V100 the SM70 platform's own
  default (1 image, no video) applies instead; the caller says so with `platform_owns_limits`.
- image budget (`--mm-processor-kwargs`): stock resizes with the checkpoint's budget
  (`size.longest_edge` = 16,777,216 pixels for Flash-Next); the default here is 1,048,576 pixels
  (`images_kwargs.size.longest_edge`), so transformers' smart_resize (aspect kept, sides rounded
  to the 32-pixel patch-merge unit) shrinks a larger image before the vision encoder, and vLLM's
  start-up memory profile, which asks the same budget, plans for at most 1,024 image tokens per
  image instead of 16,384. An explicit `size`, `min_pixels`, `max_pixels` or `do_resize`, flat or
  inside `images_kwargs`, keeps priority: the budget is then left out entirely; a request's own
  kwargs win over it anyway (vLLM merges request over server kwargs).
- video frames (`--media-io-kwargs`): for Qwen4Exp's video processor (transformers'
  `Qwen3VLVideoProcessor`) stock picks its `qwen3_vl` video loader, which samples 2 frames per
  second (at least 4, at most 768) and ignores `num_frames`. The default here is vLLM's uniform
  loader (`video_backend` "opencv", which honours `num_frames`) with 16 frames spread evenly over
  the clip (fewer when the clip has fewer); an explicit `num_frames` sets the count, an explicit
  `video_backend` other than "opencv" keeps that loader and its own sampling.

No vLLM import: the functions take and return plain mappings, and bad values raise
`MultimodalDefaultsError` naming the option, the field and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("Qwen4ExpForConditionalGeneration",)

DEFAULT_LIMITS: dict[str, int] = {"image": 8, "video": 1, "audio": 1}
IMAGE_MAX_PIXELS = 1_048_576  # 1024 x 1024 in area
CHECKPOINT_IMAGE_MAX_PIXELS = 16_777_216  # Flash-Next's preprocessor_config size.longest_edge
CHECKPOINT_IMAGE_MIN_PIXELS = 65_536  # ... and size.shortest_edge
VIDEO_NUM_FRAMES = 16
VIDEO_BACKEND = "opencv"  # vLLM's uniform sampler: num_frames evenly spaced frames
IMAGE_SIZING_KEYS = ("size", "min_pixels", "max_pixels", "do_resize")

IMAGE_BUDGET_KWARGS: dict[str, Any] = {"images_kwargs": {"size": {"longest_edge": IMAGE_MAX_PIXELS}}}
RESTORE_CHECKPOINT_BUDGET = (
    "--mm-processor-kwargs '"
    f'{{"images_kwargs": {{"size": {{"longest_edge": {CHECKPOINT_IMAGE_MAX_PIXELS}, '
    f'"shortest_edge": {CHECKPOINT_IMAGE_MIN_PIXELS}}}}}}}'
    "'"
)


class MultimodalDefaultsError(ValueError):
    """A multimodal setting that cannot work; the message names the option, the field and the fix."""


@dataclass(frozen=True)
class MultimodalSettings:
    """The three settings the defaults touch, as vLLM's options spell them."""

    limits: dict[str, int] = field(default_factory=dict)  # --limit-mm-per-prompt counts
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)  # --mm-processor-kwargs
    media_io_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)  # --media-io-kwargs


@dataclass(frozen=True)
class Resolved:
    settings: MultimodalSettings
    applied: tuple[str, ...]  # what the defaults filled in, one phrase each (empty: nothing)


def _is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_limits(user_limits: Mapping[str, int], *, platform_owns_limits: bool = False) -> dict[str, int]:
    """Per-request item limits: each modality the user named keeps its count, the rest the default.

    `user_limits` empty means no `--limit-mm-per-prompt`. With `platform_owns_limits` (the SM70
    platform applies its own default later) the user's limits are returned unchanged.
    """
    for modality, count in user_limits.items():
        if not _is_whole(count) or count < 0:
            raise MultimodalDefaultsError(
                f"--limit-mm-per-prompt: {modality!r} must be a whole number of items >= 0 (0 disables "
                f"{modality}), got {count!r}; e.g. --limit-mm-per-prompt "
                f'\'{{"image": {DEFAULT_LIMITS["image"]}, "video": {DEFAULT_LIMITS["video"]}}}\''
            )
    if platform_owns_limits:
        return dict(user_limits)
    return {**DEFAULT_LIMITS, **user_limits}


def explicit_image_sizing(mm_processor_kwargs: Mapping[str, Any]) -> list[str]:
    """The explicit image sizing settings in `--mm-processor-kwargs` (flat or in `images_kwargs`)."""
    found = [key for key in IMAGE_SIZING_KEYS if key in mm_processor_kwargs]
    images_kwargs = mm_processor_kwargs.get("images_kwargs")
    if isinstance(images_kwargs, Mapping):
        found += [f"images_kwargs.{key}" for key in IMAGE_SIZING_KEYS if key in images_kwargs]
    return found


def _check_image_sizing(scope: str, kwargs: Mapping[str, Any]) -> None:
    fix = f"to restore the checkpoint's budget use {RESTORE_CHECKPOINT_BUDGET}"
    if "do_resize" in kwargs and not isinstance(kwargs["do_resize"], bool):
        raise MultimodalDefaultsError(
            f"--mm-processor-kwargs: {scope}do_resize must be true or false, got {kwargs['do_resize']!r}"
        )
    size = kwargs.get("size")
    if size is not None and not isinstance(size, Mapping):
        raise MultimodalDefaultsError(
            f"--mm-processor-kwargs: {scope}size must be an object with shortest_edge and/or longest_edge "
            f"(pixel counts), got {size!r}; {fix}"
        )
    edges = {f"size.{k}": v for k, v in (size or {}).items() if k in ("shortest_edge", "longest_edge")}
    edges.update({k: kwargs[k] for k in ("min_pixels", "max_pixels") if k in kwargs})
    for name, value in edges.items():
        if value is not None and (not _is_whole(value) or value <= 0):
            raise MultimodalDefaultsError(
                f"--mm-processor-kwargs: {scope}{name} must be a whole number of pixels > 0, got {value!r}; {fix}"
            )
    low = kwargs.get("min_pixels", (size or {}).get("shortest_edge"))
    high = kwargs.get("max_pixels", (size or {}).get("longest_edge"))
    if _is_whole(low) and _is_whole(high) and low > high:
        raise MultimodalDefaultsError(
            f"--mm-processor-kwargs: {scope}the minimum image area ({low} pixels) exceeds the maximum "
            f"({high} pixels); smart_resize needs min <= max: lower {scope}min_pixels (size.shortest_edge) or "
            f"raise {scope}max_pixels (size.longest_edge)"
        )


def resolve_mm_processor_kwargs(mm_processor_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`--mm-processor-kwargs` with the 1,048,576-pixel image budget, unless the user sized images."""
    _check_image_sizing("", mm_processor_kwargs)
    images_kwargs = mm_processor_kwargs.get("images_kwargs")
    if images_kwargs is not None and not isinstance(images_kwargs, Mapping):
        raise MultimodalDefaultsError(
            f"--mm-processor-kwargs: images_kwargs must be an object, got {images_kwargs!r}; "
            f"e.g. {RESTORE_CHECKPOINT_BUDGET}"
        )
    _check_image_sizing("images_kwargs.", images_kwargs or {})
    if explicit_image_sizing(mm_processor_kwargs):
        return dict(mm_processor_kwargs)
    merged_images = {**(images_kwargs or {}), **IMAGE_BUDGET_KWARGS["images_kwargs"]}
    return {**mm_processor_kwargs, "images_kwargs": merged_images}


def resolve_media_io_kwargs(media_io_kwargs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """`--media-io-kwargs` with video sampled uniformly at 16 frames, unless the user chose otherwise."""
    video = media_io_kwargs.get("video", {})
    if not isinstance(video, Mapping):
        raise MultimodalDefaultsError(
            f'--media-io-kwargs: "video" must be an object, got {video!r}; e.g. '
            f'--media-io-kwargs \'{{"video": {{"num_frames": {VIDEO_NUM_FRAMES}}}}}\''
        )
    resolved = {modality: dict(kwargs) for modality, kwargs in media_io_kwargs.items()}
    if "num_frames" in video:
        frames = video["num_frames"]
        if not _is_whole(frames) or (frames <= 0 and frames != -1):
            raise MultimodalDefaultsError(
                f"--media-io-kwargs: video.num_frames must be a whole number of frames > 0 (or -1 for every "
                f"frame), got {frames!r}; leave it out for the default of {VIDEO_NUM_FRAMES}"
            )
    if video.get("video_backend", VIDEO_BACKEND) != VIDEO_BACKEND:
        return resolved  # the user's loader, with its own sampling
    resolved["video"] = {"video_backend": VIDEO_BACKEND, "num_frames": VIDEO_NUM_FRAMES, **video}
    return resolved


def resolve(user: MultimodalSettings, *, platform_owns_limits: bool = False) -> Resolved:
    """All three defaults on the user's settings, and a phrase for each default that was applied."""
    limits = resolve_limits(user.limits, platform_owns_limits=platform_owns_limits)
    mm_kwargs = resolve_mm_processor_kwargs(user.mm_processor_kwargs)
    media = resolve_media_io_kwargs(user.media_io_kwargs)
    applied = []
    defaulted = {m: n for m, n in limits.items() if m not in user.limits}
    if defaulted:
        counts = ", ".join(f"{n} {m}" for m, n in defaulted.items())
        applied.append(f"at most {counts} item(s) per request (--limit-mm-per-prompt overrides each modality it names)")
    if mm_kwargs != dict(user.mm_processor_kwargs):
        applied.append(
            f"images above {IMAGE_MAX_PIXELS:,} pixels resized with smart_resize (at most "
            f"{IMAGE_MAX_PIXELS // 32**2:,} image tokens per image; {RESTORE_CHECKPOINT_BUDGET} restores the "
            f"checkpoint's {CHECKPOINT_IMAGE_MAX_PIXELS:,})"
        )
    if media != {m: dict(k) for m, k in user.media_io_kwargs.items()}:
        frames = media["video"].get("num_frames", VIDEO_NUM_FRAMES)
        applied.append(f"video sampled uniformly ({VIDEO_BACKEND} loader), {frames} frames per video")
    return Resolved(MultimodalSettings(limits, mm_kwargs, media), tuple(applied))
