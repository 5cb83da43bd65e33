"""The `qwen3_8_flash_next*` alias gets stock vLLM's MTP speculative-config mapping, like `qwen4_exp*`.

Stock vLLM maps the model types ``qwen4_exp`` / ``qwen4_exp_text`` to the ``Qwen4ExpMTP`` draft
(`SpeculativeConfig.hf_config_override`). The alias config classes present the official
``model_type`` on their instances, so vLLM's own mapping applies unchanged (no patch). Running
MTP runs on stock's `Qwen4ExpMTP` on CUDA >= 8.0 in bf16 and on the portable drafter elsewhere
(test_qwen38_mtp_drafter.py, test_qwen38_spec_verify_engine.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

MTP = {"mtp_num_hidden_layers": 1}


def draft_of(model: Path) -> Any:
    """The draft ModelConfig vLLM builds for ``--speculative-config '{"method": "mtp", ...}'``."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    target = ModelConfig(model=str(model), dtype="bfloat16", max_model_len=512)
    spec = SpeculativeConfig(
        method="mtp", num_speculative_tokens=1, target_model_config=target, target_parallel_config=ParallelConfig()
    )
    return spec.draft_model_config


def test_alias_checkpoint_maps_to_the_same_mtp_draft(tiny_checkpoint: Callable[..., Path]) -> None:
    from vllm.config import ParallelConfig

    from qwen38_plugin import register

    register()
    official = tiny_checkpoint("qwen4_exp_text", overrides=MTP)
    alias = tiny_checkpoint("qwen3_8_flash_next_text", overrides=MTP)
    assert json.loads((alias / "config.json").read_text())["model_type"] == "qwen3_8_flash_next_text"
    a, b = draft_of(official), draft_of(alias)
    assert type(b.hf_config).__name__ == "Qwen3_8FlashNextTextConfig"  # loaded through the alias class
    for draft in (a, b):
        assert draft.architectures == ["Qwen4ExpMTP"]
        assert draft.hf_config.model_type == "qwen4_exp_mtp"
        assert draft.hf_config.n_predict == 1
        assert draft.get_num_layers(ParallelConfig()) == 1
    fields = ("n_predict", "hc_mult", "index_share_for_mtp_iteration", "architectures", "model_type")
    assert {f: getattr(a.hf_config, f) for f in fields} == {f: getattr(b.hf_config, f) for f in fields}
    # every other field too; to_dict() writes the class's spelling, and the paths differ
    da, db = a.hf_config.to_dict(), b.hf_config.to_dict()
    assert (da.pop("model_type"), db.pop("model_type")) == ("qwen4_exp_text", "qwen3_8_flash_next_text")
    assert (da.pop("_name_or_path"), db.pop("_name_or_path")) == (str(official), str(alias))
    assert da == db


@pytest.mark.parametrize(("alias_name", "official_name"), [("Qwen3_8FlashNextConfig", "Qwen4ExpConfig")])
def test_multimodal_alias_config_maps_like_qwen4_exp(alias_name: str, official_name: str) -> None:
    import transformers
    from vllm.config import SpeculativeConfig

    from qwen38_plugin import configs

    text = {"hidden_size": 64, "num_hidden_layers": 4, "mtp_num_hidden_layers": 2, "hc_count": 2}
    arch = ["Qwen4ExpForConditionalGeneration"]
    official_config = getattr(transformers, official_name)(text_config=dict(text), architectures=arch)
    alias_config = getattr(configs, alias_name)(text_config=dict(text), architectures=arch)
    official = SpeculativeConfig.hf_config_override(official_config)
    alias = SpeculativeConfig.hf_config_override(alias_config)
    for config in (official, alias):
        assert (config.architectures, config.model_type, config.n_predict, config.hc_mult) == (
            ["Qwen4ExpMTP"], "qwen4_exp_mtp", 2, 2,
        )  # fmt: skip
