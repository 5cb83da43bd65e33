"""What qwen38_plugin registers for Qwen4ExpForCausalLM, and the documented switch."""

from __future__ import annotations

import pytest

from qwen38_plugin import _registration
from qwen38_plugin.dispatch import DispatchError


def test_cpu_platform_takes_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_registration.FORCE_ENV, raising=False)
    assert _registration.portable_model_reason() == "CPU platform"


def test_switch_forces_or_forbids_the_portable_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_registration.FORCE_ENV, "1")
    assert _registration.portable_model_reason() == "QWEN38_FORCE_PORTABLE=1"
    monkeypatch.setenv(_registration.FORCE_ENV, "0")
    assert _registration.portable_model_reason() is None
    summary = _registration._registration_summary()
    assert summary == "Qwen4ExpForCausalLM dispatcher (QWEN38_FORCE_PORTABLE=0: stock's only)"
    monkeypatch.setenv(_registration.FORCE_ENV, "yes")
    with pytest.raises(DispatchError, match="QWEN38_FORCE_PORTABLE='yes': use 1"):
        _registration.portable_model_reason()


def test_registry_resolves_the_architecture_to_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm import ModelRegistry

    monkeypatch.delenv(_registration.FORCE_ENV, raising=False)
    registered = _registration.register_with_vllm()
    assert registered[-1] == "portable Qwen4ExpForCausalLM (CPU platform)"
    model_cls = ModelRegistry._try_load_model_cls("Qwen4ExpForCausalLM")
    assert getattr(model_cls, "is_qwen38_dispatcher", False)
    # the MTP drafter goes through the same rule, and the architectures' config hooks wrap stock's
    assert "Qwen4ExpMTP dispatcher (the same rule)" in registered
    assert getattr(ModelRegistry._try_load_model_cls("Qwen4ExpMTP"), "is_qwen38_dispatcher", False)
    from vllm.model_executor.models.config import (
        MODELS_CONFIG_MAP,
        Qwen4ExpForCausalLMConfig,
        Qwen4ExpForConditionalGenerationConfig,
    )

    assert MODELS_CONFIG_MAP["Qwen4ExpForCausalLM"].qwen38_wraps is Qwen4ExpForCausalLMConfig  # type: ignore[attr-defined]
    # ... and the multimodal architecture's (its MTP drafter reads the same streams) over the
    # multimodal defaults' hook, which wraps stock's
    mm_hook = MODELS_CONFIG_MAP["Qwen4ExpForConditionalGeneration"]
    assert mm_hook.qwen38_wraps.wrapped is Qwen4ExpForConditionalGenerationConfig  # type: ignore[attr-defined]
    _registration.register_with_vllm()  # idempotent: nothing wrapped twice
    assert MODELS_CONFIG_MAP["Qwen4ExpForConditionalGeneration"] is mm_hook
