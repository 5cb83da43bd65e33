"""The `qwen3_8_flash_next` spelling of Qwen4Exp configs.

Renamed Qwen3.8 Flash-Next checkpoints declare `qwen3_8_flash_next` (multimodal)
or `qwen3_8_flash_next_text` (text only). They carry exactly the fields of
transformers' `qwen4_exp` / `qwen4_exp_text` configs, so the alias classes only
change `model_type`; everything else, validation included, is inherited.

The alias spelling lives on the *class*: AutoConfig finds the class by it and
``config.json`` is written with it (transformers serialises ``type(config).model_type``).
A loaded config *instance* reports the official spelling as its ``model_type``, so that
every consumer that branches on ``config.model_type`` treats an alias checkpoint as the
Qwen4Exp checkpoint it is: vLLM's speculative config maps ``qwen4_exp`` /
``qwen4_exp_text`` to the ``Qwen4ExpMTP`` draft, its Qwen Triton warm-up and
transformers' checkpoint conversion mappings are keyed the same way. No vLLM code is patched.
"""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import AutoConfig, Qwen4ExpConfig, Qwen4ExpTextConfig


class Qwen3_8FlashNextTextConfig(Qwen4ExpTextConfig):
    model_type = "qwen3_8_flash_next_text"

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        self.__dict__["model_type"] = Qwen4ExpTextConfig.model_type  # see the module docstring


class Qwen3_8FlashNextConfig(Qwen4ExpConfig):
    model_type = "qwen3_8_flash_next"
    sub_configs: ClassVar[dict[str, type]] = {**Qwen4ExpConfig.sub_configs, "text_config": Qwen3_8FlashNextTextConfig}

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        self.__dict__["model_type"] = Qwen4ExpConfig.model_type  # see the module docstring


ALIAS_CONFIGS: dict[str, type] = {
    Qwen3_8FlashNextTextConfig.model_type: Qwen3_8FlashNextTextConfig,
    Qwen3_8FlashNextConfig.model_type: Qwen3_8FlashNextConfig,
}


def register_alias_configs() -> list[str]:
    """Make transformers' AutoConfig resolve the alias model types."""
    for model_type, config_cls in ALIAS_CONFIGS.items():
        AutoConfig.register(model_type, config_cls, exist_ok=True)
    return list(ALIAS_CONFIGS)


def register_transformers_model_aliases() -> None:
    """Let transformers save and load alias checkpoints exactly like `qwen4_exp` ones.

    transformers renames checkpoint tensors (per-expert weights to fused ones and back)
    through conversion mappings keyed by model type; without these entries an alias
    checkpoint would be written with different tensor names. Not part of `register()`:
    vLLM loads weights itself, and building the mapping table costs most of a second.
    """
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    register_alias_configs()
    for alias, official in (("qwen3_8_flash_next_text", "qwen4_exp_text"), ("qwen3_8_flash_next", "qwen4_exp")):
        mapping = get_checkpoint_conversion_mapping(official)
        if mapping is not None:
            register_checkpoint_conversion_mapping(alias, mapping, overwrite=True)
