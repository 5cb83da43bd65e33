"""The classes behind the `Qwen4ExpForConditionalGeneration` architecture (images and video).

- `OwnedMemoryQwen4ExpForConditionalGeneration`: stock vLLM's class (the nvidia or amd one, as
  stock's package picks per platform) whose encoder outputs own their memory
  (`qwen38_plugin.encoder_outputs`, issue 13 item 5). It only overrides `embed_multimodal`.
- `PortableQwen4ExpForConditionalGeneration`: the same class for everything multimodal (the
  multimodal processor registered on stock's class, `embed_multimodal`, Qwen3-VL's M-RoPE
  positions, `embed_input_ids`, the checkpoint name mapping), built from vLLM's Qwen3-VL vision
  tower and the portable text model (`qwen38_plugin.vllm_model`), for where stock's cannot run
  (CPU, CUDA < 8.0, fp16 / fp32).
- `Qwen4ExpForConditionalGeneration`, the class registered under the architecture name: builds
  one of the two per model by the rule of `qwen38_plugin.dispatch` (stock's on CUDA >= 8.0 or
  ROCm in bfloat16, the portable one elsewhere), as `vllm_dispatch.Qwen4ExpForCausalLM` does for
  the text architecture. It is a subclass of stock's, so vLLM's class inspection and multimodal
  processor lookup see stock's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from vllm.model_executor.models.interfaces import SupportsMambaPrefixCaching
from vllm.models.qwen4_exp import Qwen4ExpForConditionalGeneration as _StockQwen4ExpForConditionalGeneration

from qwen38_plugin.dispatch import MM_ARCHITECTURE, DispatchError, announce, choose, current_config, implementation
from qwen38_plugin.encoder_outputs import own_memory
from qwen38_plugin.model import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

# The vision RoPE vLLM's Qwen3-VL tower implements: axial, base 10,000 (it does not read the config).
VISION_ROPE_TYPE = "axial"
VISION_ROPE_THETA = 10_000.0


class OwnedMemoryQwen4ExpForConditionalGeneration(_StockQwen4ExpForConditionalGeneration):
    """Stock's Qwen4ExpForConditionalGeneration; each encoder output owns its memory."""

    is_qwen38_owned_encoder_outputs = True

    def embed_multimodal(self, **kwargs: object) -> Any:
        outputs = super().embed_multimodal(**kwargs)
        if outputs is None or isinstance(outputs, torch.Tensor) or len(outputs) == 0:
            return outputs  # nothing, or one batched tensor that owns its storage
        return own_memory(outputs)


def check_multimodal_config(vllm_config: VllmConfig) -> None:
    """What the portable multimodal model refuses at startup, each naming the field and the fix."""
    config = vllm_config.model_config.hf_config
    vision = config.vision_config
    deepstack = list(getattr(vision, "deepstack_visual_indexes", None) or [])
    if deepstack:
        raise ConfigError(
            f"vision_config.deepstack_visual_indexes: {deepstack}: the portable Qwen4Exp model has no deepstack "
            "(transformers' Qwen4Exp vision model has none either); serve a checkpoint without it (an empty list)"
        )
    rope = dict(getattr(vision, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", VISION_ROPE_TYPE)
    theta = float(rope.get("rope_theta", VISION_ROPE_THETA))
    if rope_type != VISION_ROPE_TYPE or theta != VISION_ROPE_THETA:
        raise ConfigError(
            f"vision_config.rope_parameters: rope_type {rope_type!r}, rope_theta {theta:g}: vLLM's Qwen3-VL vision "
            f"tower rotates with {VISION_ROPE_TYPE!r} RoPE at base {VISION_ROPE_THETA:g} whatever the config says; "
            f"serve a checkpoint with rope_theta {VISION_ROPE_THETA:g}"
        )
    mm_config = vllm_config.model_config.multimodal_config
    language_model_only = mm_config is not None and mm_config.language_model_only
    text_rope = vllm_config.model_config.hf_text_config.rope_parameters or {}
    if not language_model_only and not text_rope.get("mrope_section"):
        # transformers rotates image and video tokens by their (T, H, W) grid whether or not the
        # config names the sections; vLLM computes those positions only when it does.
        raise ConfigError(
            "text_config.rope_parameters.mrope_section is missing: transformers' Qwen4Exp applies M-RoPE with its "
            "default sections [11, 11, 10] anyway, but vLLM computes M-RoPE positions only for a config that names "
            'them; add "mrope_section": [11, 11, 10] (the sections the checkpoint was trained with) to '
            "text_config.rope_parameters, or serve text only with --language-model-only"
        )
    if mm_config is not None and not language_model_only and mm_config.mm_device_do_normalize:
        mismatch = video_normalization_mismatch(vllm_config)
        if mismatch is not None:
            raise ConfigError(
                f"video_processor: {mismatch}; vLLM's on-device normalization (--mm-device-do-normalize, on by "
                "default) applies the image processor's to video frames too, so videos would be normalized wrongly: "
                "serve with --no-mm-device-do-normalize (the processor then normalizes each modality with its own)"
            )
    if mm_config is not None and mm_config.is_multimodal_pruning_enabled():
        raise ConfigError(
            f"--video-pruning-rate {mm_config.video_pruning_rate}: the portable Qwen4Exp model does not support "
            "multimodal pruning (it changes the layout of the M-RoPE positions); drop --video-pruning-rate"
        )


def video_normalization_mismatch(vllm_config: VllmConfig) -> str | None:
    """How the video processor's rescale and normalization differ from the image processor's, which
    vLLM's on-device normalization applies to both modalities (None when they agree)."""
    from vllm.model_executor.layers.fusion.mm_input_norm import _load_norm_params
    from vllm.transformers_utils.processor import get_video_processor

    model_config = vllm_config.model_config
    image = _load_norm_params(model_config)
    video: Any = get_video_processor(
        model_config.model, revision=model_config.revision, trust_remote_code=model_config.trust_remote_code
    )
    rescale = float(video.rescale_factor) if video.do_rescale else 1.0
    mean = [float(v) for v in video.image_mean] if video.do_normalize else [0.0] * len(image.image_mean)
    std = [float(v) for v in video.image_std] if video.do_normalize else [1.0] * len(image.image_std)
    if (rescale, mean, std) == (image.rescale_factor, image.image_mean, image.image_std):
        return None
    return (
        f"rescale {rescale:g}, mean {mean}, std {std} differ from the image processor's rescale "
        f"{image.rescale_factor:g}, mean {image.image_mean}, std {image.image_std}"
    )


class PortableQwen4ExpForConditionalGeneration(OwnedMemoryQwen4ExpForConditionalGeneration, SupportsMambaPrefixCaching):
    """Qwen4ExpForConditionalGeneration for vLLM on CPU, CUDA < 8.0 and fp16 / fp32: vLLM's Qwen3-VL
    vision tower and the portable text model, stock's class for the rest (see the module docstring)."""

    is_portable_qwen4exp: ClassVar[bool] = True
    # The portable text model's fused modules (it keeps the indexer projection apart), plus the
    # vision tower's packed QKV.
    packed_modules_mapping = {  # noqa: RUF012  # an instance variable on stock's class
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
        "in_proj_ba": ["in_proj_b", "in_proj_a"],
        "qkv": ["qkv"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model") -> None:
        from vllm.model_executor.layers.fusion.mm_input_norm import build_mm_input_norm
        from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer
        from vllm.model_executor.models.utils import StageMissingLayer, maybe_prefix
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        from qwen38_plugin.vllm_model import PortableQwen4ExpForCausalLM

        nn.Module.__init__(self)
        check_multimodal_config(vllm_config)
        config = vllm_config.model_config.hf_config
        multimodal_config = vllm_config.model_config.multimodal_config
        if multimodal_config is None:
            raise ConfigError(f"{MM_ARCHITECTURE} needs vLLM's multimodal config (vLLM builds one for it)")
        self.config = config  # type: ignore[assignment]  # Qwen4ExpConfig
        # vLLM's V1 speculative proposer copies the target's `config.image_token_index` into the
        # drafter's config for multimodal targets it does not list by class name (ours among them);
        # Qwen4ExpConfig calls it image_token_id.
        if not hasattr(config, "image_token_index"):
            config.image_token_index = config.image_token_id
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.multimodal_config = multimodal_config
        self.language_model_only = multimodal_config.language_model_only
        # What stock's (Qwen3-VL's) multimodal methods read: no deepstack, no pruning (refused above).
        self.use_deepstack = False
        self.deepstack_num_level = 0
        self.visual_dim = config.vision_config.out_hidden_size
        self.multiscale_dim = 0
        if self.language_model_only:
            self.use_data_parallel = False
            self.is_multimodal_pruning_enabled = False
            self.video_pruning_method = None
            self.video_pruning_rate = 0.0
            self._tokenizer = None
            self.visual = StageMissingLayer("vision_tower")  # type: ignore[assignment]
        else:
            self.use_data_parallel = multimodal_config.mm_encoder_tp_mode == "data"
            self._init_video_pruning(multimodal_config)
            self._tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
            with self._mark_tower_model(vllm_config, {"image", "video"}):
                self.visual = Qwen3_VisionTransformer(
                    config.vision_config,
                    norm_eps=config.text_config.rms_norm_eps,
                    quant_config=vllm_config.quant_config,
                    input_norm=build_mm_input_norm(self.model_config),
                    prefix=maybe_prefix(prefix, "visual"),
                )
        with self._mark_language_model(vllm_config):
            self.language_model = PortableQwen4ExpForCausalLM(  # type: ignore[assignment]
                vllm_config=vllm_config, prefix=maybe_prefix(prefix, "language_model")
            )

    # -- vLLM's hybrid-model interface: the portable text model's states --------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> Any:
        from qwen38_plugin.vllm_model import PortableQwen4ExpForCausalLM

        return PortableQwen4ExpForCausalLM.get_mamba_state_shape_from_config(vllm_config)

    @classmethod
    def get_mamba_state_dtype_from_config(  # type: ignore[override]  # one dtype per state of the slot
        cls, vllm_config: VllmConfig
    ) -> tuple[torch.dtype, ...]:
        from qwen38_plugin.vllm_model import PortableQwen4ExpForCausalLM

        return PortableQwen4ExpForCausalLM.get_mamba_state_dtype_from_config(vllm_config)

    @classmethod
    def get_mamba_specs_from_config(cls, vllm_config: VllmConfig) -> Any:
        """One slot layout (stock's declares two: its PLE states live apart from the GDN ones)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        shapes = cls.get_mamba_state_shape_from_config(vllm_config)
        dtypes = cls.get_mamba_state_dtype_from_config(vllm_config)
        return (MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1),)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[Any, ...]:
        from qwen38_plugin.vllm_model import PortableQwen4ExpForCausalLM

        return PortableQwen4ExpForCausalLM.get_mamba_state_copy_func()

    @classmethod
    def get_mamba_state_copy_funcs_from_config(
        cls, vllm_config: VllmConfig, mamba_types: set[MambaAttentionBackendEnum]
    ) -> dict[MambaAttentionBackendEnum, tuple[Any, ...]]:
        from qwen38_plugin.vllm_model import PortableQwen4ExpForCausalLM

        return PortableQwen4ExpForCausalLM.get_mamba_state_copy_funcs_from_config(vllm_config, mamba_types)

    def get_mamba_state_copy_funcs(  # type: ignore[override]
        self, mamba_types: set[MambaAttentionBackendEnum]
    ) -> dict[MambaAttentionBackendEnum, tuple[Any, ...]]:
        return self.get_mamba_state_copy_funcs_from_config(self.vllm_config, mamba_types)

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:
        """The text model's streams before its final mixer, for an MTP head (None without one)."""
        from qwen38_plugin.vllm_model import PortableQwen4ExpForCausalLM

        language_model = self.language_model
        assert isinstance(language_model, PortableQwen4ExpForCausalLM)
        return language_model.get_mtp_target_hidden_states()

    # -- forward --------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> Any:
        """``positions``: vLLM's M-RoPE positions ``[3, T]`` (``[T]`` in language-model-only mode);
        ``inputs_embeds``: the text embeddings with the encoder outputs scattered over their
        placeholders; ``input_ids`` (placeholders included) feed PLE's n-gram hashes."""
        if input_ids is None:
            raise NotImplementedError("the portable Qwen4Exp model needs token ids (PLE hashes them)")
        return self.language_model.model(input_ids, positions, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

        # Stock's mapping (model.visual. -> visual., model.language_model. -> language_model.model.,
        # lm_head. -> language_model.lm_head., mtp. dropped; the tower's weights too without a
        # tower); the vision tower and the text model then load their parts with their own loaders.
        mapper = self.hf_to_vllm_mapper | WeightsMapper(
            orig_to_new_prefix={"visual.": None} if self.language_model_only else {}
        )
        return AutoWeightsLoader(self).load_weights(weights, mapper=mapper)


class Qwen4ExpForConditionalGeneration(OwnedMemoryQwen4ExpForConditionalGeneration):
    """Builds `OwnedMemoryQwen4ExpForConditionalGeneration` (stock's) or
    `PortableQwen4ExpForConditionalGeneration` per model (see the module docstring); never itself a model.

    Everything vLLM reads from the class before a model exists is stock's (the interfaces, the
    multimodal processor, the weight mapping), except the hybrid-state classmethods, which answer
    for the implementation the config chooses."""

    is_qwen38_dispatcher: ClassVar[bool] = True
    supports_mamba_prefix_caching: ClassVar[bool] = True  # the portable model's (vLLM 0.32 does not read it)

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = "model") -> Any:
        if cls is not Qwen4ExpForConditionalGeneration:
            raise DispatchError(f"{MM_ARCHITECTURE} through qwen38_plugin serves generation, not as {cls.__name__}")
        return _chosen_class(vllm_config)(vllm_config=vllm_config, prefix=prefix)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model") -> None:  # pragma: no cover
        # Python skips __init__ because __new__ returns an instance of another class.
        raise AssertionError("the Qwen4Exp multimodal dispatcher is never instantiated itself")

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> Any:
        return _chosen_class(vllm_config).get_mamba_state_shape_from_config(vllm_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> Any:
        return _chosen_class(vllm_config).get_mamba_state_dtype_from_config(vllm_config)

    @classmethod
    def get_mamba_specs_from_config(cls, vllm_config: VllmConfig) -> Any:
        return _chosen_class(vllm_config).get_mamba_specs_from_config(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls) -> Any:
        return _chosen_class(_current_config()).get_mamba_state_copy_func()

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types: set[Any]) -> Any:
        config = _current_config()
        chosen: Any = _chosen_class(config)
        if hasattr(chosen, "get_mamba_state_copy_funcs_from_config"):
            return chosen.get_mamba_state_copy_funcs_from_config(config, mamba_types)
        return chosen.get_mamba_state_copy_funcs(mamba_types)


def _chosen_class(vllm_config: VllmConfig) -> Any:
    choice = choose(vllm_config, MM_ARCHITECTURE)
    announce(choice)
    return implementation(choice)


def _current_config() -> VllmConfig:
    return current_config(MM_ARCHITECTURE)
