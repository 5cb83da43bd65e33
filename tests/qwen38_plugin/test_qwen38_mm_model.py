"""Which class serves `Qwen4ExpForConditionalGeneration` (images and video), and what the portable
one refuses at startup. On real `VllmConfig` objects of the tiny multimodal checkpoint (vLLM's
`EngineArgs`), on this CPU and, by naming the platform, as if on CUDA; the portable model is built
here from vLLM's layers (no engine: test_qwen38_mm_engine.py serves it).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from qwen38_plugin import dispatch
from qwen38_plugin.dispatch import FORCE_ENV, MM_ARCHITECTURE, DispatchError, decide, target_of
from qwen38_plugin.model import ConfigError
from tests.qwen38_plugin.mm_checkpoint import mm_checkpoint

CUDA_90 = ("cuda", (9, 0))


def engine_config(model: Path | None = None, **kwargs: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    import qwen38_plugin

    qwen38_plugin.register()
    model = model or mm_checkpoint("qwen4_exp")
    return EngineArgs(model=str(model), max_model_len=1024, enforce_eager=True, **kwargs).create_engine_config()


@pytest.fixture(scope="module")
def configs() -> dict[str, Any]:
    return {dtype: engine_config(dtype=dtype) for dtype in ("bfloat16", "float32")}


def test_rule_as_for_the_text_architecture(configs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from qwen38_plugin.vllm_mm_model import (
        OwnedMemoryQwen4ExpForConditionalGeneration,
        PortableQwen4ExpForConditionalGeneration,
    )

    monkeypatch.delenv(FORCE_ENV, raising=False)
    on_cpu = dispatch.choose(configs["bfloat16"], MM_ARCHITECTURE)
    assert on_cpu == dispatch.Choice(True, "CPU platform", MM_ARCHITECTURE)
    assert on_cpu.describe() == f"{MM_ARCHITECTURE}: portable (qwen38_plugin) implementation (CPU platform)"
    assert dispatch.implementation(on_cpu) is PortableQwen4ExpForConditionalGeneration
    # The tiny checkpoint leaves output_gate_type unset and this machine has no FlashInfer: stock's
    # would not start, so the portable model is chosen, saying why ...
    as_here = target_of(configs["bfloat16"], CUDA_90, MM_ARCHITECTURE)
    assert decide(as_here, None).portable and "output_gate_type unset" in decide(as_here, None).reason
    # ... and where stock's has what it needs, stock's (with memory-owning encoder outputs) serves
    h200_bf16 = decide(dataclasses.replace(as_here, stock_lacks=()), None)
    assert h200_bf16 == dispatch.Choice(False, "cuda 9.0, bfloat16: stock's runs here", MM_ARCHITECTURE)
    assert dispatch.implementation(h200_bf16) is OwnedMemoryQwen4ExpForConditionalGeneration
    h200_fp32 = decide(target_of(configs["float32"], CUDA_90, MM_ARCHITECTURE), None)
    assert h200_fp32.portable and "stock's QSA attention requires bfloat16" in h200_fp32.reason
    with pytest.raises(DispatchError, match=f"stock vLLM's {MM_ARCHITECTURE} cannot run here: CPU platform"):
        decide(target_of(configs["bfloat16"], architecture=MM_ARCHITECTURE), "0")


def test_dispatcher_reports_stock_interfaces_to_the_registry() -> None:
    from vllm.model_executor.models.registry import _ModelInfo
    from vllm.models.qwen4_exp import Qwen4ExpForConditionalGeneration as stock

    from qwen38_plugin.vllm_mm_model import PortableQwen4ExpForConditionalGeneration, Qwen4ExpForConditionalGeneration

    ours = dataclasses.asdict(_ModelInfo.from_model_cls(Qwen4ExpForConditionalGeneration))
    theirs = dataclasses.asdict(_ModelInfo.from_model_cls(stock))
    differ = {k for k in ours if ours[k] != theirs[k]}
    assert differ == {"supports_mamba_prefix_caching"}, {k: (ours[k], theirs[k]) for k in differ}
    assert ours["supports_multimodal"] and ours["is_hybrid"] and ours["requires_raw_input_tokens"]
    portable = dataclasses.asdict(_ModelInfo.from_model_cls(PortableQwen4ExpForConditionalGeneration))
    assert not [k for k, v in portable.items() if v is True and ours[k] is not True]
    assert Qwen4ExpForConditionalGeneration._processor_factory is stock._processor_factory


def test_dispatcher_builds_the_portable_model(configs: dict[str, Any], vllm_single_rank: None) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    from qwen38_plugin.vllm_mm_model import PortableQwen4ExpForConditionalGeneration, Qwen4ExpForConditionalGeneration
    from qwen38_plugin.vllm_model import PortableQwen4ExpForCausalLM

    config = configs["float32"]
    model = initialize_model(config, model_class=Qwen4ExpForConditionalGeneration)
    assert type(model) is PortableQwen4ExpForConditionalGeneration
    assert isinstance(model.visual, Qwen3_VisionTransformer) and model.visual.deepstack_visual_indexes == []
    assert type(model.language_model) is PortableQwen4ExpForCausalLM
    # the hybrid states are the portable text model's: one slot layout (GDN and PLE states)
    shapes = PortableQwen4ExpForCausalLM.get_mamba_state_shape_from_config(config)
    assert Qwen4ExpForConditionalGeneration.get_mamba_state_shape_from_config(config) == shapes
    assert Qwen4ExpForConditionalGeneration.get_mamba_state_dtype_from_config(config) == (
        PortableQwen4ExpForCausalLM.get_mamba_state_dtype_from_config(config)
    )
    (spec,) = Qwen4ExpForConditionalGeneration.get_mamba_specs_from_config(config)
    assert spec.shapes == shapes
    gdn = {MambaAttentionBackendEnum.GDN_ATTN}
    with set_current_vllm_config(config):
        from_class = Qwen4ExpForConditionalGeneration.get_mamba_state_copy_funcs(gdn)
    assert from_class == model.get_mamba_state_copy_funcs(gdn)
    # M-RoPE: the QSA key ring keeps each row's three rope positions
    context = config.compilation_config.static_forward_context
    rings = [layer for name, layer in context.items() if name.endswith(".self_attn.kv.key_ring")]
    assert rings and all(ring.rope_position_offset is not None for ring in rings)


def _without(edit: Any) -> Any:
    config = engine_config(dtype="float32")
    edit(config.model_config)
    return config


def test_startup_refusals_name_the_field_and_the_fix(configs: dict[str, Any], tmp_path: Path) -> None:
    from qwen38_plugin.vllm_mm_model import check_multimodal_config

    check_multimodal_config(configs["float32"])  # the tiny checkpoint passes
    deepstack = _without(lambda m: setattr(m.hf_config.vision_config, "deepstack_visual_indexes", [0, 1]))
    with pytest.raises(ConfigError, match=r"vision_config.deepstack_visual_indexes: \[0, 1\]: .*an empty list"):
        check_multimodal_config(deepstack)
    theta = _without(
        lambda m: setattr(m.hf_config.vision_config, "rope_parameters", {"rope_type": "axial", "rope_theta": 1e6})
    )
    with pytest.raises(ConfigError, match=r"rope_theta 1e\+06: .*serve a checkpoint with rope_theta 10000"):
        check_multimodal_config(theta)
    no_sections = _without(lambda m: m.hf_text_config.rope_parameters.pop("mrope_section"))
    with pytest.raises(ConfigError, match=r"mrope_section is missing: .*--language-model-only"):
        check_multimodal_config(no_sections)
    # options and checkpoints are refused while vLLM builds its config (the config hook, before any
    # worker starts), wrapped by pydantic as stock's own config errors are
    with pytest.raises(ValueError, match=r"--video-pruning-rate 0.5: .*drop --video-pruning-rate"):
        engine_config(dtype="float32", video_pruning_rate=0.5)
    # A processor normalizing images with CLIP's statistics and videos with 0.5 / 0.5: vLLM's
    # on-device normalization would apply the image's to video frames.
    clip = tmp_path / "clip-mean"
    shutil.copytree(mm_checkpoint("qwen4_exp"), clip)
    processor = json.loads((clip / "processor_config.json").read_text())
    processor["image_processor"].update(image_mean=[0.48145466, 0.4578275, 0.40821073],
                                        image_std=[0.26862954, 0.26130258, 0.27577711])  # fmt: skip
    (clip / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(
        ValueError, match=r"video_processor: rescale .* differ .*serve with --no-mm-device-do-normalize"
    ):
        engine_config(clip, dtype="float32")
    check_multimodal_config(engine_config(clip, dtype="float32", mm_device_do_normalize=False))


def test_language_model_only_builds_no_tower(vllm_single_rank: None) -> None:
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models.utils import StageMissingLayer

    from qwen38_plugin.vllm_mm_model import PortableQwen4ExpForConditionalGeneration, Qwen4ExpForConditionalGeneration

    config = engine_config(dtype="float32", language_model_only=True)
    # stock's config hook strips the M-RoPE sections: text positions only, nothing to refuse
    assert not config.model_config.uses_mrope
    model = initialize_model(config, model_class=Qwen4ExpForConditionalGeneration)
    assert type(model) is PortableQwen4ExpForConditionalGeneration
    assert isinstance(model.visual, StageMissingLayer)
