"""SM70 platform quirks (R59 bf16 -> fp16 and the fp16 range at load, R14 the multimodal default),
as the SM70 platform applies them in `check_and_update_config` (`sm70_config.apply_quirks`), on
stand-in configs (no GPU here)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from sm70_backend import quirks, sm70_config


@pytest.fixture(autouse=True)
def _fresh_log_once() -> None:
    sm70_config._announced.clear()


def test_bf16_runs_as_fp16_below_8_0_only() -> None:
    dtype, message = quirks.run_dtype_on_sm70(torch.bfloat16, (7, 0))
    assert dtype == torch.float16 and message is not None and "compute capability 7.0" in message
    assert quirks.run_dtype_on_sm70(torch.float16, (7, 0)) == (torch.float16, None)
    assert quirks.run_dtype_on_sm70(torch.float32, (7, 0)) == (torch.float32, None)
    assert quirks.run_dtype_on_sm70(torch.bfloat16, (8, 0)) == (torch.bfloat16, None)


def test_fp16_range_violations_count_finite_values_beyond_65504() -> None:
    fine = torch.randn(64, 64, dtype=torch.bfloat16)
    big = torch.randn(32, 8, dtype=torch.bfloat16)
    big[3, 1], big[7, 7], big[0, 0] = 7.0e4, -1.0e6, float("inf")  # inf is not a range problem
    edge = torch.tensor([65504.0, -65504.0, 65520.0], dtype=torch.float32)  # 65520 rounds to inf in fp16
    assert torch.isinf(edge.half()[2]) and not torch.isinf(edge.half()[:2]).any()
    tensors = [("fine", fine), ("big", big), ("edge", edge), ("ids", torch.arange(10)), ("half", edge.half())]
    violations = quirks.fp16_range_violations(tensors)
    assert [(v.name, v.count) for v in violations] == [("big", 2), ("edge", 1)]
    assert violations[0].max_abs == pytest.approx(1.0e6, rel=1e-2)
    assert "big: 2 values beyond ±65504" in quirks.fp16_range_report(violations)


def make_checkpoint(directory: Path, overflow: bool) -> Path:
    directory.mkdir()
    a = torch.randn(16, 16, dtype=torch.bfloat16)
    b = torch.randn(4, dtype=torch.bfloat16)
    if overflow:
        b[2] = 1.5e5
    save_file({"model.a.weight": a}, str(directory / "model-00001-of-00002.safetensors"))
    save_file({"model.b.bias": b}, str(directory / "model-00002-of-00002.safetensors"))
    return directory


def config(model: Path, dtype: torch.dtype, limits: dict[str, int] | None, backend: str | None = None):  # type: ignore[no-untyped-def]
    from vllm.config.multimodal import MultiModalConfig

    mm = (
        None
        if limits is None
        else SimpleNamespace(limit_per_prompt=MultiModalConfig._validate_limit_per_prompt(limits))
    )
    model_config = SimpleNamespace(
        dtype=dtype, model=str(model), hf_config=SimpleNamespace(dtype=torch.bfloat16), multimodal_config=mm
    )
    return SimpleNamespace(model_config=model_config, attention_config=SimpleNamespace(backend=backend))


def test_bf16_checkpoint_on_sm70_runs_fp16_with_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    vllm_config = config(make_checkpoint(tmp_path / "ok", overflow=False), torch.bfloat16, None)
    with caplog.at_level(logging.INFO, logger="vllm.plugins.sm70_backend"):
        sm70_config.apply_quirks(vllm_config, (7, 0))
        sm70_config.apply_quirks(vllm_config, (7, 0))  # a second pass (another process's view) adds nothing
    assert vllm_config.model_config.dtype == torch.float16
    lines = [r.getMessage() for r in caplog.records]
    assert sum("bfloat16 runs as float16" in line for line in lines) == 1
    assert any("fits float16's range" in line for line in lines)


def test_values_outside_fp16_range_are_reported_at_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = make_checkpoint(tmp_path / "big", overflow=True)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.sm70_backend"):
        sm70_config.apply_quirks(config(checkpoint, torch.bfloat16, None), (7, 0))
    assert any("model.b.bias: 1 values beyond ±65504" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("VLLM_SM70_FP16_RANGE_CHECK", "error")
    with pytest.raises(ValueError, match=r"model.b.bias: 1 values beyond ±65504 \(largest \|x\| 149504\)"):
        sm70_config.apply_quirks(config(checkpoint, torch.bfloat16, None), (7, 0))
    monkeypatch.setenv("VLLM_SM70_FP16_RANGE_CHECK", "off")
    sm70_config.apply_quirks(config(checkpoint, torch.bfloat16, None), (7, 0))  # no scan, no error


def test_sm70_multimodal_default(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoint = make_checkpoint(tmp_path / "mm", overflow=False)
    with caplog.at_level(logging.INFO, logger="vllm.plugins.sm70_backend"):
        unset = config(checkpoint, torch.float16, {})
        sm70_config.apply_quirks(unset, (7, 0))
    limits = unset.model_config.multimodal_config.limit_per_prompt
    assert {k: v.count for k, v in limits.items()} == {"image": 1, "video": 0}
    assert any(r.getMessage().startswith("Using SM70 Flash-V100 multimodal default") for r in caplog.records)
    without_video = config(checkpoint, torch.float16, {"image": 8, "audio": 1})
    sm70_config.apply_quirks(without_video, (7, 0))
    assert {k: v.count for k, v in without_video.model_config.multimodal_config.limit_per_prompt.items()} == {
        "image": 8, "audio": 1, "video": 0
    }  # fmt: skip
    explicit = config(checkpoint, torch.float16, {"image": 16, "video": 1, "audio": 16})
    sm70_config.apply_quirks(explicit, (7, 0))
    assert explicit.model_config.multimodal_config.limit_per_prompt["video"].count == 1
    other_backend = config(checkpoint, torch.float16, {}, backend="TRITON_ATTN")
    sm70_config.apply_quirks(other_backend, (7, 0))
    assert dict(other_backend.model_config.multimodal_config.limit_per_prompt) == {}  # stock's default
    assert quirks.sm70_mm_limits(None)[0] == {"image": 1, "video": 0}
