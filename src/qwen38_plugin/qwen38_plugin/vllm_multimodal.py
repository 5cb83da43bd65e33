"""The multimodal defaults of `qwen38_plugin.multimodal_defaults` inside stock vLLM.

vLLM keeps one config hook per architecture (`MODELS_CONFIG_MAP` in
`vllm.model_executor.models.config`, a plain dict; `VllmConfig.__post_init__` calls the
architecture's `verify_and_update_config` once, before the platform's own hook). `install()`
puts a subclass of stock's hook for `Qwen4ExpForConditionalGeneration` there: it runs stock's
hook, then fills in what the user left unset on the `MultiModalConfig` vLLM built from
`--limit-mm-per-prompt`, `--mm-processor-kwargs` and `--media-io-kwargs`. Everything else is
stock's: its multimodal processor (transformers' smart_resize) resizes with the budget, its
profiler sizes the dummy image from it, its chat parser counts the items of every message
against the limits, its video loader samples the frames. The resolved config travels to the
engine core and workers with the rest of the `VllmConfig`.

Alias checkpoints (`qwen3_8_flash_next`) declare the same architecture, so they get the same hook.

On a V100 with FLASH_ATTN_V100 the SM70 platform (sm70_backend) owns the limits: it says so with
`owns_multimodal_default(vllm_config)` and sets 1 image and no video in its own hook, which runs
after this one; the limits are then left to it (the image budget and the frames still apply).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from qwen38_plugin.multimodal_defaults import ARCHITECTURES, MultimodalSettings, resolve

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.plugins.qwen38_plugin")

HOOK_MARKER = "qwen38_multimodal_defaults"


def platform_owns_limits(vllm_config: VllmConfig, platform: Any = None) -> bool:
    """Whether the platform applies its own multimodal limits to this config (the SM70 platform)."""
    if platform is None:
        from vllm.platforms import current_platform

        platform = current_platform
    # Looked up on the class: vLLM's Platform.__getattr__ warns about every attribute it lacks.
    owns = getattr(platform if isinstance(platform, type) else type(platform), "owns_multimodal_default", None)
    return bool(owns is not None and owns(vllm_config))


def apply_multimodal_defaults(vllm_config: VllmConfig, platform: Any = None) -> tuple[str, ...]:
    """Fill in the defaults on `vllm_config`'s multimodal config; return what was applied."""
    model_config = vllm_config.model_config
    mm_config = getattr(model_config, "multimodal_config", None)
    if mm_config is None or mm_config.language_model_only:
        return ()
    from vllm.config.multimodal import MultiModalConfig

    user = MultimodalSettings(
        limits={modality: options.count for modality, options in mm_config.limit_per_prompt.items()},
        mm_processor_kwargs=dict(mm_config.mm_processor_kwargs or {}),
        media_io_kwargs={modality: dict(kwargs) for modality, kwargs in mm_config.media_io_kwargs.items()},
    )
    owned = platform_owns_limits(vllm_config, platform)
    resolved = resolve(user, platform_owns_limits=owned)
    added = {m: n for m, n in resolved.settings.limits.items() if m not in user.limits}
    if added:
        # The user's entries keep their dummy-data options (width, num_frames...); only the
        # modalities they left out are added, as vLLM's own validator builds them.
        limits = MultiModalConfig._validate_limit_per_prompt({})
        limits.update(mm_config.limit_per_prompt)
        limits.update(MultiModalConfig._validate_limit_per_prompt(dict(added)))
        mm_config.limit_per_prompt = limits
    if resolved.settings.mm_processor_kwargs != user.mm_processor_kwargs:
        mm_config.mm_processor_kwargs = resolved.settings.mm_processor_kwargs
    if resolved.settings.media_io_kwargs != user.media_io_kwargs:
        mm_config.media_io_kwargs = resolved.settings.media_io_kwargs
    applied = resolved.applied + (("limits: the platform's own multimodal default",) if owned else ())
    if applied:
        logger.info(
            "qwen38_plugin: Qwen4Exp multimodal defaults for %s: %s",
            model_config.architecture,
            "; ".join(applied),
        )
    return applied


def _hook_class(previous: Any) -> type:
    from vllm.model_executor.models.config import VerifyAndUpdateConfig

    base = previous if previous is not None else VerifyAndUpdateConfig

    class Qwen38MultimodalDefaults(base):  # type: ignore[misc,valid-type]  # stock's hook, then ours
        wrapped: ClassVar[Any] = previous

        @staticmethod
        def verify_and_update_config(vllm_config: VllmConfig) -> None:
            if previous is not None:
                previous.verify_and_update_config(vllm_config)
            apply_multimodal_defaults(vllm_config)

    setattr(Qwen38MultimodalDefaults, HOOK_MARKER, True)
    return Qwen38MultimodalDefaults


def install() -> list[str]:
    """Wrap stock's config hook of each Qwen4Exp multimodal architecture (idempotent)."""
    from vllm.model_executor.models import config as model_configs

    hooks = getattr(model_configs, "MODELS_CONFIG_MAP", None)
    if not isinstance(hooks, dict):
        import vllm

        raise RuntimeError(
            f"qwen38_plugin: vLLM {vllm.__version__} has no per-architecture config hooks "
            "(vllm.model_executor.models.config.MODELS_CONFIG_MAP) to apply the Qwen4Exp multimodal defaults "
            "through; install vLLM 0.32 or 0.33, or remove qwen38_plugin from VLLM_PLUGINS."
        )
    installed = []
    for architecture in ARCHITECTURES:
        previous = hooks.get(architecture)
        if not getattr(previous, HOOK_MARKER, False):
            hooks[architecture] = _hook_class(previous)
        installed.append(architecture)
    return installed
