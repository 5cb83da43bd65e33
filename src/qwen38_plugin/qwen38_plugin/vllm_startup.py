"""What the portable Qwen4Exp model refuses or settles at startup, before any worker starts.

The checks run twice: in the config hook (`vllm_config_hook`), in the process that builds vLLM's
config, so a refusal reaches the user in seconds, the way stock's own config errors do (wrapped
by pydantic: "1 validation error for VllmConfig / Value error, <the message>"), instead of after
every worker has started and loaded; and again in the model's constructor, for a config built
another way. Each refusal names the option or field and the fix. This module imports no vLLM
model code, so the API server does not load the model's layers to run it.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from qwen38_plugin.model import ConfigError, check_config, check_tensor_parallel

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def check_vllm_config(vllm_config: VllmConfig, on_cuda: bool | None = None) -> None:
    """What the portable model refuses at startup, each naming the option or field and the fix
    (``on_cuda``: the platform's, unless given)."""
    config = vllm_config.model_config.hf_text_config
    if on_cuda is None:
        from vllm.platforms import current_platform

        on_cuda = current_platform.is_cuda_alike()
    if on_cuda and vllm_config.model_config.dtype == torch.float32:
        # Found on the H200: vLLM's Gated DeltaNet prefill kernel (its copy of fla's chunked delta
        # rule) asserts on float32 during the profiling run, for stock's GDN models too.
        raise ConfigError(
            "--dtype float32: on CUDA vLLM's Gated DeltaNet prefill kernel supports float16 and bfloat16 "
            "only; serve with --dtype float16 or --dtype bfloat16 (float32 runs on CPU)"
        )
    rope = config.rope_parameters or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(
            f"rope_parameters.rope_type: {rope_type!r} is not implemented by the portable Qwen4Exp model (it would "
            "run with unscaled RoPE); serve a checkpoint with the default RoPE"
        )
    parallel = vllm_config.parallel_config
    dcp = parallel.decode_context_parallel_size
    speculative = vllm_config.speculative_config
    if dcp > 1 and speculative is not None and (on_cuda or speculative.method != "mtp"):
        # The QSA layers split their K/V over the DCP group, and so does the MTP head's QSA layer where it
        # keeps its caches itself (vLLM's V1 runner: the CPU); other drafters' attention and CUDA do not yet.
        where = "on CUDA" if on_cuda else f"with the {speculative.method!r} method"
        raise ConfigError(
            f"--decode-context-parallel-size {dcp} with --speculative-config {where}: the portable Qwen4Exp model "
            "splits its draft layers' K/V over decode-context-parallel ranks only for MTP on CPU; drop one of the two"
        )
    if dcp > 1 and speculative is not None and vllm_config.model_config.uses_mrope:
        raise ConfigError(
            f"--decode-context-parallel-size {dcp} with --speculative-config on a multimodal (M-RoPE) checkpoint: "
            "the MTP head's indexer does not keep M-RoPE positions across decode-context-parallel ranks; drop one of "
            "the two"
        )
    if parallel.prefill_context_parallel_size > 1:
        raise ConfigError(
            f"--prefill-context-parallel-size {parallel.prefill_context_parallel_size}: the portable Qwen4Exp model "
            "does not support prefill context parallelism; leave it at 1"
        )
    check_config(config)
    check_tensor_parallel(config, vllm_config.parallel_config.tensor_parallel_size, split_vocabulary=False)


# FlashInfer's Hopper GDN prefill (the version vLLM 0.32 pins) takes head dims of 128 only and raises
# "DSL kernel only supports D=128" at the first prefill otherwise, while vLLM's "auto" picks it on
# SM90 whatever the head dims (it checks them on Blackwell only).
FLASHINFER_GDN_HEAD_DIM = 128


def gdn_prefill_backend(
    requested: object, head_k_dim: int, head_v_dim: int, *, flashinfer_installed: bool
) -> str | None:
    """The ``gdn_prefill_backend`` to set before vLLM's GDN layers are built, or None to keep the
    request. Unset: Triton where FlashInfer is missing or cannot take the head dims; an explicit
    "flashinfer" that cannot take them is refused here, at startup, naming both fields."""
    fits = head_k_dim == FLASHINFER_GDN_HEAD_DIM and head_v_dim == FLASHINFER_GDN_HEAD_DIM
    if requested is None or str(requested).strip().lower() == "auto":
        return None if flashinfer_installed and fits else "triton"
    if str(requested).strip().lower() == "flashinfer" and not fits:
        raise ConfigError(
            f"--gdn-prefill-backend flashinfer (additional_config gdn_prefill_backend) needs the config's "
            f"linear_key_head_dim and linear_value_head_dim to be {FLASHINFER_GDN_HEAD_DIM} (FlashInfer's GDN prefill "
            f"takes no other); this checkpoint has {head_k_dim} and {head_v_dim}. Leave the option out or pass "
            "--gdn-prefill-backend triton."
        )
    return None


def prefer_triton_prefill(vllm_config: VllmConfig) -> None:
    """Settle vLLM's GDN prefill kernel once per config (`gdn_prefill_backend`).

    vLLM's GDN layer and its metadata builder both read ``additional_config["gdn_prefill_backend"]``
    ("auto" picks FlashInfer on Hopper); set before either is built, so they agree.
    """
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        return
    config = vllm_config.model_config.hf_text_config
    choice = gdn_prefill_backend(
        extra.get("gdn_prefill_backend"), config.linear_key_head_dim, config.linear_value_head_dim,
        flashinfer_installed=importlib.util.find_spec("flashinfer") is not None,
    )  # fmt: skip
    if choice is not None:
        extra["gdn_prefill_backend"] = choice


def settle_portable_config(vllm_config: VllmConfig) -> None:
    """The config hook's part: the refusals, then the GDN prefill kernel (both idempotent)."""
    check_vllm_config(vllm_config)
    prefer_triton_prefill(vllm_config)
