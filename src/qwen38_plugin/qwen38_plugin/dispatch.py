"""Which implementation serves `Qwen4ExpForCausalLM` and `Qwen4ExpForConditionalGeneration` (images
and video): stock vLLM's or qwen38_plugin's portable one.

`register()` cannot see the model dtype (it runs before any config exists), so it registers a
dispatching class (`qwen38_plugin.vllm_dispatch`, `qwen38_plugin.vllm_mm_model`) under each
architecture name instead of a model; the class applies the rule below wherever vLLM hands it a
`VllmConfig`. This module holds the rule and imports vLLM only inside functions, so `register()`
stays cheap.

The rule (`decide`): ours where stock's cannot run, stock's everywhere else.
- stock cannot run on the CPU platform, on CUDA below compute capability 8.0, on platforms
  other than CUDA and ROCm, and in any dtype but bfloat16 (its QSA attention requires bf16);
  nor on a checkpoint that leaves ``output_gate_type`` unset (its GDN layer asserts on it, where
  transformers and the portable model use ``hidden_act``), nor on CUDA without the packages its
  kernels import (FlashInfer, the CUTLASS DSL): seen on an H200 with stock vLLM 0.32, where
  either made the engine fail at startup; nor on CUDA with a QSA block top-k
  (``indexer_budget / indexer_compress_ratio``) its top-k kernel does not take (512, 1024, 2048):
  seen on an H100, where a block top-k of 8 failed the engine in its first prefill;
- ``QWEN38_FORCE_PORTABLE=1`` picks ours everywhere; ``=0`` picks stock's everywhere and fails
  at startup, saying why, where stock's cannot run (no silent fallback either way).
The choice is logged once per process, with the reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from vllm.config import VllmConfig

ARCHITECTURE = "Qwen4ExpForCausalLM"
MM_ARCHITECTURE = "Qwen4ExpForConditionalGeneration"
# The speculative methods the portable model serves (None: no speculation). DFlash reads the
# target's auxiliary hidden states reduced by `hc_mean` (dflash2 checks the drafter declares it).
PORTABLE_SPECULATIVE_METHODS = (None, "mtp", "dflash")

# The MTP drafter vLLM builds for ``--speculative-config '{"method": "mtp", ...}'``.
MTP_ARCHITECTURE = "Qwen4ExpMTP"
PORTABLE_MODEL = "qwen38_plugin.vllm_model:PortableQwen4ExpForCausalLM"
# Per architecture: the portable implementation, and stock's where the plugin wraps it (the
# multimodal one: stock's class with encoder outputs owning their memory); else vLLM's table's.
PORTABLE_MODELS = {
    ARCHITECTURE: PORTABLE_MODEL,
    MM_ARCHITECTURE: "qwen38_plugin.vllm_mm_model:PortableQwen4ExpForConditionalGeneration",
    MTP_ARCHITECTURE: "qwen38_plugin.vllm_mtp:PortableQwen4ExpMTP",
}
STOCK_MODELS = {MM_ARCHITECTURE: "qwen38_plugin.vllm_mm_model:OwnedMemoryQwen4ExpForConditionalGeneration"}
FORCE_ENV = "QWEN38_FORCE_PORTABLE"

logger = logging.getLogger("vllm.plugins.qwen38_plugin")


class DispatchError(ValueError):
    """No implementation of Qwen4ExpForCausalLM can serve this configuration; says why and the fix."""


@dataclass(frozen=True)
class Target:
    """What the choice depends on: where the model runs and how it is asked to run."""

    platform: str  # "cpu", "cuda", "rocm" or another vLLM platform name
    capability: tuple[int, int] | None  # CUDA compute capability (None elsewhere)
    dtype: torch.dtype
    speculative_method: str | None = None
    prefix_caching: bool = False
    pipeline_parallel_size: int = 1
    enable_hc_sp: bool = False
    # vLLM's V2 model runner (its default on CUDA); the CPU runs V1 (read off the CPU only)
    v2_model_runner: bool = True
    # What stock's model needs from the checkpoint or the installation that is missing here.
    stock_lacks: tuple[str, ...] = ()
    architecture: str = ARCHITECTURE

    def describe(self) -> str:
        where = (
            self.platform if self.capability is None else f"{self.platform} {self.capability[0]}.{self.capability[1]}"
        )
        return f"{where}, {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class Choice:
    portable: bool
    reason: str
    architecture: str = ARCHITECTURE

    def describe(self) -> str:
        which = "portable (qwen38_plugin)" if self.portable else "stock vLLM's"
        return f"{self.architecture}: {which} implementation ({self.reason})"


def read_force(environ: Mapping[str, str] | None = None) -> str | None:
    """The ``QWEN38_FORCE_PORTABLE`` switch: "1", "0" or None (unset); anything else is refused."""
    value = (os.environ if environ is None else environ).get(FORCE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise DispatchError(f"{FORCE_ENV}={value!r}: use 1 (always the portable model) or 0 (never), or unset it")
    return value or None


def why_stock_cannot_run(target: Target) -> str | None:
    """Why stock vLLM's Qwen4ExpForCausalLM cannot run for `target`, or None if it can."""
    if target.platform == "cpu":
        return "CPU platform"
    if target.platform == "cuda" and target.capability is not None and target.capability < (8, 0):
        return f"CUDA capability {target.capability[0]}.{target.capability[1]} < 8.0"
    if target.platform not in ("cuda", "rocm"):
        return f"{target.platform} platform (stock's runs on CUDA and ROCm only)"
    if target.dtype != torch.bfloat16:
        return f"dtype {str(target.dtype).removeprefix('torch.')} (stock's QSA attention requires bfloat16)"
    if target.stock_lacks:
        return "; ".join(target.stock_lacks)
    return None


# Modules stock's CUDA Qwen4Exp imports while it builds or warms up, and the packages that hold them.
STOCK_CUDA_MODULES = (("flashinfer", "flashinfer-python"), ("cutlass", "nvidia-cutlass-dsl"))
# The QSA block top-k (indexer_budget / indexer_compress_ratio) stock's CUDA indexer selects with:
# its persistent_topk kernel (prefill) takes only these ("persistent_topk supports k=512, k=1024, or
# k=2048, got k=8" on an H100 with vLLM 0.32, 2026-12-05).
STOCK_CUDA_BLOCK_TOPKS = (512, 1024, 2048)


def stock_cuda_topk_refuses(hf_config: Any) -> str | None:
    """Why stock's CUDA top-k kernel would refuse this config's QSA block top-k, or None."""
    budget, ratio = getattr(hf_config, "indexer_budget", None), getattr(hf_config, "indexer_compress_ratio", None)
    indexed = "indexed_attention" in (getattr(hf_config, "layer_types", None) or ())
    if not indexed or budget is None or not ratio or budget // ratio in STOCK_CUDA_BLOCK_TOPKS:
        return None
    return (
        f"indexer_budget {budget} / indexer_compress_ratio {ratio} is a QSA block top-k of {budget // ratio}, "
        f"and stock's CUDA top-k kernel takes {', '.join(map(str, STOCK_CUDA_BLOCK_TOPKS))} only"
    )


def stock_lacks(hf_config: Any, platform: str) -> tuple[str, ...]:
    """What stock's Qwen4ExpForCausalLM needs that this checkpoint or installation lacks."""
    lacks = []
    if getattr(hf_config, "output_gate_type", None) is None:
        lacks.append(
            "the config leaves output_gate_type unset (stock's GDN layer asserts on it; transformers and the "
            "portable model use hidden_act)"
        )
    if platform == "cuda":
        missing = [package for module, package in STOCK_CUDA_MODULES if importlib.util.find_spec(module) is None]
        if missing:
            lacks.append(f"stock's CUDA kernels need {' and '.join(missing)}, not installed")
        refused = stock_cuda_topk_refuses(hf_config)
        if refused is not None:
            lacks.append(refused)
    return tuple(lacks)


def decide(target: Target, force: str | None) -> Choice:
    """Pick the implementation for `target` under the switch value `force` ("1", "0" or None)."""
    blocker = why_stock_cannot_run(target)
    arch = target.architecture
    if force == "1":
        choice = Choice(True, f"{FORCE_ENV}=1", arch)
    elif force == "0":
        if blocker is not None:
            raise DispatchError(
                f"{FORCE_ENV}=0 forbids the portable Qwen4Exp model, but stock vLLM's {arch} cannot run "
                f"here: {blocker}. Unset {FORCE_ENV} to serve with qwen38_plugin's portable model, or run on "
                "CUDA >= 8.0 (or ROCm) in bfloat16 with a config that sets output_gate_type and stock's kernel "
                "packages installed."
            )
        choice = Choice(False, f"{FORCE_ENV}=0", arch)
    elif blocker is not None:
        choice = Choice(True, blocker, arch)
    else:
        choice = Choice(False, f"{target.describe()}: stock's runs here", arch)
    if choice.portable:
        _refuse_what_portable_lacks(target, choice)
    return choice


def _refuse_what_portable_lacks(target: Target, choice: Choice) -> None:
    lacks = []
    method = target.speculative_method
    if method is not None and method != "mtp" and target.architecture == MM_ARCHITECTURE:
        # The portable multimodal model hands an MTP head its text model's streams; a DFlash
        # drafter's target features are proven for the text-only model only.
        lacks.append(
            f"speculative method {method!r} with the multimodal {MM_ARCHITECTURE} (its drafter is the checkpoint's "
            'MTP head): use --speculative-config \'{"method": "mtp", ...}\' or drop --speculative-config'
        )
    elif method not in PORTABLE_SPECULATIVE_METHODS:
        # The portable model drafts with the checkpoint's MTP head or verifies a DFlash drafter's
        # blocks from its `hc_mean` auxiliary hidden states (README, "Speculative decoding");
        # other proposers are not proven through a real engine here.
        lacks.append(
            f"speculative method {method!r} (the portable model drafts with its MTP head or a DFlash drafter "
            'only): use --speculative-config \'{"method": "mtp", ...}\' or \'{"method": "dflash", ...}\', '
            "or drop --speculative-config"
        )
    if method is not None and target.prefix_caching and target.platform == "cpu":
        # vLLM's V1 CPU runner copies mamba states for prefix caching while speculating ("align"
        # mode) with a Triton kernel the CPU build cannot run: it would fail at the first step.
        lacks.append(
            "--enable-prefix-caching together with --speculative-config on CPU (vLLM's CPU runner cannot copy "
            "the recurrent states for it): pass --no-enable-prefix-caching"
        )
    if method == "dflash" and target.platform != "cpu" and not target.v2_model_runner:
        # On the H200 (2026-12-02, benchmarks/qwen38_plugin/results/h200_spec.txt) DFlash in vLLM's V2
        # model runner (its default on CUDA) gave the target's greedy tokens and accepted drafts; in
        # the V1 runner the tokens were the target's too, but not one of 992 drafts was accepted, so
        # every verify step would cost a draft for nothing.
        lacks.append(
            f"speculative method 'dflash' in vLLM's V1 model runner on {target.platform} (no draft was ever "
            "accepted there on the H200): unset VLLM_USE_V2_MODEL_RUNNER or set it to 1"
        )
    if method == "dflash" and target.prefix_caching:
        # The QSA block keys are declared DCP-sharded beside a DFlash drafter (vllm_qsa_cache), and
        # vLLM then groups them so that prefix-cache hits stop.
        lacks.append(
            "--enable-prefix-caching together with speculative method 'dflash' (the portable model's QSA block "
            "keys then get no prefix-cache hits): pass --no-enable-prefix-caching"
        )
    if target.pipeline_parallel_size > 1:
        lacks.append(f"pipeline_parallel_size={target.pipeline_parallel_size}: use --pipeline-parallel-size 1")
    if target.enable_hc_sp:
        lacks.append("--enable-hc-sp (hyper-connection sequence parallelism): drop it")
    if lacks:
        raise DispatchError(
            f"{target.architecture} runs on qwen38_plugin's portable model here ({choice.reason}), which does not "
            f"support: {'; '.join(lacks)}"
        )


def target_of(
    vllm_config: VllmConfig,
    platform: tuple[str, tuple[int, int] | None] | None = None,
    architecture: str = ARCHITECTURE,
) -> Target:
    """The `Target` of a vLLM config for `architecture` on this process's platform (or on
    `platform`, for tests)."""
    if platform is None:
        platform = current_platform_target()
    dtype = vllm_config.model_config.dtype
    if not isinstance(dtype, torch.dtype):
        raise DispatchError(f"model dtype {dtype!r} is not resolved; vLLM should have resolved it to a torch dtype")
    spec = vllm_config.speculative_config
    parallel = vllm_config.parallel_config
    return Target(
        platform=platform[0],
        capability=platform[1],
        dtype=dtype,
        speculative_method=spec.method if spec is not None else None,
        prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        enable_hc_sp=bool(getattr(parallel, "enable_hc_sp", False)),
        v2_model_runner=platform[0] != "cpu" and bool(vllm_config.use_v2_model_runner),
        stock_lacks=stock_lacks(vllm_config.model_config.hf_text_config, platform[0]),
        architecture=architecture,
    )


def current_platform_target() -> tuple[str, tuple[int, int] | None]:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu", None
    if current_platform.is_cuda():
        capability = current_platform.get_device_capability()
        return "cuda", None if capability is None else (capability.major, capability.minor)
    if current_platform.is_rocm():
        return "rocm", None
    return str(getattr(current_platform, "device_name", None) or type(current_platform).__name__), None


def current_config(architecture: str) -> VllmConfig:
    """The vLLM config being built (the dispatching classes' classmethods are asked outside a model)."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    if config.model_config is None:
        raise DispatchError(
            f"{architecture}: stock's or the portable implementation is chosen per vLLM config; call this on "
            "the built model or inside set_current_vllm_config"
        )
    return config


def choose(vllm_config: VllmConfig, architecture: str = ARCHITECTURE) -> Choice:
    return decide(target_of(vllm_config, architecture=architecture), read_force())


_announced: set[str] = set()


def announce(choice: Choice) -> None:
    """Log the choice once per process (vLLM builds and inspects the model several times)."""
    line = choice.describe()
    if line not in _announced:
        _announced.add(line)
        logger.info("qwen38_plugin chose %s", line)


def implementation(choice: Choice) -> type[nn.Module]:
    if choice.portable:
        module_name, class_name = PORTABLE_MODELS[choice.architecture].split(":")
    elif choice.architecture in STOCK_MODELS:
        module_name, class_name = STOCK_MODELS[choice.architecture].split(":")
    else:
        module_name, class_name = stock_location(choice.architecture)
    model_cls = getattr(importlib.import_module(module_name), class_name)
    assert isinstance(model_cls, type) and issubclass(model_cls, nn.Module), model_cls
    return model_cls


def stock_location(architecture: str = ARCHITECTURE) -> tuple[str, str]:
    """Where vLLM's own registry table puts stock's `architecture` (module, class)."""
    from vllm.model_executor.models import registry

    table: dict[str, Any] = getattr(registry, "_VLLM_MODELS", {})
    if architecture not in table:
        raise DispatchError(
            f"this vLLM's model table has no {architecture}: qwen38_plugin cannot find stock's implementation; "
            f"set {FORCE_ENV}=1 to serve with the portable model"
        )
    module, class_name = table[architecture]
    return registry._resolve_module_name(module), class_name
