"""The class registered as `Qwen4ExpForCausalLM`: builds stock vLLM's or the portable model.

The choice (`qwen38_plugin.dispatch.decide`) is made wherever vLLM hands the class a
`VllmConfig`: at construction (``__new__`` builds and returns the chosen implementation, so the
model vLLM holds *is* stock's or ours) and in the classmethods vLLM calls on the class before any
model exists (hybrid state shapes and dtypes).

The class reports, to vLLM's registry inspection (done once, before any config, and cached on
disk by this file's hash), the interfaces of stock's `Qwen4ExpForCausalLM` (hybrid, inner state,
PP, HC sequence parallelism, raw input tokens) plus ours' mamba prefix caching, so stock's keeps
every feature it has. Where ours is chosen, the features it lacks (PP > 1, HC SP, speculative
methods other than MTP, prefix caching with speculation on CPU) are refused at startup by the rule.
`Qwen4ExpMTP` (the drafter of ``--speculative-config method "mtp"``) is dispatched the same way.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar, _ProtocolMeta

import torch
from torch import nn
from vllm.model_executor.models.interfaces import (
    HasInnerState,
    IsHybrid,
    SupportsHCSP,
    SupportsMambaPrefixCaching,
    SupportsPP,
)

from qwen38_plugin.dispatch import (
    ARCHITECTURE,
    MTP_ARCHITECTURE,
    DispatchError,
    announce,
    choose,
    current_config,
    implementation,
    stock_location,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def _chosen_class(vllm_config: VllmConfig) -> type[nn.Module]:
    choice = choose(vllm_config)
    announce(choice)
    return implementation(choice)


# Class attributes vLLM reads from the registered class before building it, only to configure
# quantization of stock's fused modules; the dispatcher hands out stock's (imported on first use).
_STOCK_CLASS_ATTRIBUTES = ("packed_modules_mapping", "hf_to_vllm_mapper")
_STOCK_ARCHITECTURES = {"Qwen4ExpMTP": MTP_ARCHITECTURE}


class _DispatcherMeta(_ProtocolMeta):  # the interfaces are typing Protocols
    def __getattr__(cls, name: str) -> Any:
        if name in _STOCK_CLASS_ATTRIBUTES:
            module_name, class_name = stock_location(_STOCK_ARCHITECTURES.get(cls.__name__, ARCHITECTURE))
            return getattr(getattr(importlib.import_module(module_name), class_name), name)
        raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")


class Qwen4ExpForCausalLM(
    nn.Module,
    HasInnerState,
    IsHybrid,
    SupportsPP,
    SupportsHCSP,
    SupportsMambaPrefixCaching,
    metaclass=_DispatcherMeta,
):
    """Builds stock's or the portable Qwen4ExpForCausalLM (see the module docstring); never itself a model."""

    requires_raw_input_tokens: ClassVar[bool] = True  # as stock's: PLE hashes the raw token ids
    is_qwen38_dispatcher: ClassVar[bool] = True

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = "") -> Any:
        if cls is not Qwen4ExpForCausalLM:
            # vLLM's pooling adapters subclass the model class; they would wrap this dispatcher,
            # not the implementation it returns.
            raise DispatchError(
                f"{ARCHITECTURE} through qwen38_plugin serves text generation only, not as {cls.__name__}"
            )
        return _chosen_class(vllm_config)(vllm_config=vllm_config, prefix=prefix)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:  # pragma: no cover
        # Python skips __init__ because __new__ returns an instance of another class; vLLM
        # only reads this signature (it must name vllm_config and prefix).
        raise AssertionError("the Qwen4Exp dispatcher is never instantiated itself")

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> Any:  # pragma: no cover
        # These stubs make vLLM's class inspection see a text-generation model that accepts
        # intermediate tensors (pipeline parallelism), as stock's is.
        raise AssertionError("the Qwen4Exp dispatcher is never instantiated itself")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise AssertionError("the Qwen4Exp dispatcher is never instantiated itself")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:  # pragma: no cover
        raise AssertionError("the Qwen4Exp dispatcher is never instantiated itself")

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:  # pragma: no cover
        # vLLM tests for this method on the *class* (stock's has it) before building the model.
        raise AssertionError("the Qwen4Exp dispatcher is never instantiated itself")

    # -- what vLLM asks the class before a model exists -----------------------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> Any:
        return _chosen_class(vllm_config).get_mamba_state_shape_from_config(vllm_config)  # type: ignore[attr-defined]

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> Any:
        return _chosen_class(vllm_config).get_mamba_state_dtype_from_config(vllm_config)  # type: ignore[attr-defined]

    @classmethod
    def get_mamba_specs_from_config(cls, vllm_config: VllmConfig) -> Any:
        # Stock's declares several state layouts; ours has the one its two methods above describe.
        chosen: Any = _chosen_class(vllm_config)
        if hasattr(chosen, "get_mamba_specs_from_config"):
            return chosen.get_mamba_specs_from_config(vllm_config)
        from vllm.v1.kv_cache_interface import MambaSpec

        shapes = chosen.get_mamba_state_shape_from_config(vllm_config)
        dtypes = chosen.get_mamba_state_dtype_from_config(vllm_config)
        return (MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1),)

    @classmethod
    def get_mamba_state_copy_func(cls) -> Any:
        return _chosen_class(cls._current_config()).get_mamba_state_copy_func()  # type: ignore[attr-defined]

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types: set[Any]) -> Any:
        config = cls._current_config()
        chosen: Any = _chosen_class(config)
        # Ours answers from the config (its instance method needs a built model); stock's is a classmethod.
        if hasattr(chosen, "get_mamba_state_copy_funcs_from_config"):
            return chosen.get_mamba_state_copy_funcs_from_config(config, mamba_types)
        return chosen.get_mamba_state_copy_funcs(mamba_types)

    @staticmethod
    def _current_config() -> VllmConfig:
        return current_config(ARCHITECTURE)


class Qwen4ExpMTP(nn.Module, SupportsPP, SupportsHCSP, metaclass=_DispatcherMeta):
    """The class registered as `Qwen4ExpMTP` (the drafter of ``--speculative-config method "mtp"``):
    builds stock's or the portable MTP head by the target's rule (vLLM builds the drafter with the
    target's `VllmConfig`, so both sides make the same choice); never itself a model."""

    is_qwen38_dispatcher: ClassVar[bool] = True

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = "") -> Any:
        choice = choose(vllm_config, MTP_ARCHITECTURE)
        announce(choice)
        return implementation(choice)(vllm_config=vllm_config, prefix=prefix)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:  # pragma: no cover
        raise AssertionError("the Qwen4ExpMTP dispatcher is never instantiated itself")

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> Any:  # pragma: no cover
        raise AssertionError("the Qwen4ExpMTP dispatcher is never instantiated itself")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise AssertionError("the Qwen4ExpMTP dispatcher is never instantiated itself")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:  # pragma: no cover
        raise AssertionError("the Qwen4ExpMTP dispatcher is never instantiated itself")
