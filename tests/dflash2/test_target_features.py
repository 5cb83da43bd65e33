"""dflash2.target_features: a DFlash drafter must declare hc_mean for a hyper-connection target."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dflash2.target_features import DrafterConfigError, check_drafter, hyper_connection_count
from dflash2.tiny import build_tiny_drafter

HC_TARGET = {"model_type": "qwen4_exp_text", "hc_count": 4}
MULTIMODAL_HC_TARGET = {"model_type": "qwen4_exp", "text_config": {"hc_count": 4}}
PLAIN_TARGET = {"model_type": "qwen3"}


def drafter(**dflash: Any) -> dict[str, Any]:
    return {"dflash_config": {"mask_token_id": 0, "target_layer_ids": [1, 2], **dflash}}


def test_hc_mean_is_what_a_hyper_connection_target_needs() -> None:
    assert hyper_connection_count(HC_TARGET) == hyper_connection_count(MULTIMODAL_HC_TARGET) == 4
    assert hyper_connection_count(PLAIN_TARGET) == 1
    assert check_drafter(HC_TARGET, drafter(target_feature_reduction="hc_mean")) == "hc_mean"
    assert check_drafter(MULTIMODAL_HC_TARGET, drafter(target_feature_reduction="hc_mean")) == "hc_mean"
    assert check_drafter(PLAIN_TARGET, drafter()) is None


@pytest.mark.parametrize(
    ("target", "draft", "message"),
    [
        (
            HC_TARGET,
            drafter(),
            r"target has 4 hyper-connection streams, and the DFlash drafter must declare "
            r'dflash_config.target_feature_reduction = "hc_mean" in /d/config.json \(missing\). '
            r"Make a draft view that adds it and links the weights: dflash2-view /d VIEW_DIR",
        ),
        (HC_TARGET, {}, r"must declare dflash_config.target_feature_reduction"),
        (HC_TARGET, drafter(target_feature_reduction="mean"), r"= 'mean' in /d/config.json: unknown reduction"),
        (HC_TARGET, drafter(target_feature_reduction=True), r"= 'True' in /d/config.json: unknown reduction"),
        (PLAIN_TARGET, drafter(target_feature_reduction="hc_mean"), r"has no hyper-connection streams to reduce"),
    ],
)
def test_a_drafter_that_does_not_fit_is_refused_with_the_fix(target: Any, draft: Any, message: str) -> None:
    with pytest.raises(DrafterConfigError, match=message):
        check_drafter(target, draft, "/d")


def test_startup_refuses_a_drafter_without_hc_mean_for_qwen4exp(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """The real config path (stock EngineArgs, no engine) with the tiny Qwen4Exp target (4 streams)."""
    from vllm.engine.arg_utils import EngineArgs

    import dflash2

    dflash2.register()
    target = tiny_checkpoint("qwen4_exp_text", dtype="float32")

    def start(draft: Path, prefix_caching: bool = False) -> object:
        spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 4}
        return EngineArgs(
            model=str(target), dtype="float32", max_model_len=256, speculative_config=spec,
            enable_prefix_caching=prefix_caching,
        ).create_engine_config()  # fmt: skip

    plain = build_tiny_drafter(tmp_path / "plain", target)
    with pytest.raises(DrafterConfigError, match=rf'"hc_mean" in {plain}/config.json \(missing\)'):
        start(plain)
    declared = build_tiny_drafter(tmp_path / "hc", target, extra_dflash_config={"target_feature_reduction": "hc_mean"})
    # Past our check, the portable model serves DFlash (qwen38_plugin's config hook lifts stock's
    # refusal there; tests/dflash2/test_dflash_qwen4exp_engine.py runs it), without prefix caching on CPU.
    config = start(declared)
    assert config.speculative_config.method == "dflash"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="pass --no-enable-prefix-caching"):
        start(declared, prefix_caching=True)
