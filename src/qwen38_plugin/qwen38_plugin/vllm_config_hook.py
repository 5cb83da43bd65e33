"""The config hooks of the ``Qwen4ExpForCausalLM`` and ``Qwen4ExpForConditionalGeneration``
architectures (vLLM's ``MODELS_CONFIG_MAP``):
stock's, plus what vLLM's V1 MTP proposer needs to read the target's residual streams.

An MTP head for this model reads the target's streams before its final mixer, ``[T, hc * H]``
(`get_mtp_target_hidden_states`). vLLM's V1 proposer (``v1/spec_decode/llm_base_proposer.py``,
the one the CPU model runner uses) sizes its hidden-state buffer ``draft hidden_size`` wide, times
``hc_mult`` only when the draft's config also has ``compress_ratios`` (its test for a DeepSeek V4
draft, whose MTP reads the same kind of streams). vLLM's own MTP override already sets ``hc_mult``
(= ``hc_count``) on the Qwen4Exp draft config; `widen_draft_hidden_buffer` adds
``compress_ratios`` (each draft layer's QSA ``indexer_compress_ratio``) to the draft config alone,
before the proposer is built, so the buffer is ``hc * H`` wide. No vLLM function is replaced.
The V2 model runner's speculator widens by ``hc_mult`` on its own (keyed on the target having
`get_mtp_target_hidden_states`) and never reads ``compress_ratios``.

Where the portable model is chosen, the hook also runs its startup refusals and settles its GDN
prefill kernel (`refuse_early`, `qwen38_plugin.vllm_startup`), so a config it cannot serve fails in
seconds instead of after the workers start.

The hook runs for stock's and the portable model alike (the buffer is the proposer's, whichever
model drafts).

Stock's hook also refuses every speculative method but MTP and n-gram. Where the dispatcher picks
the portable model (`qwen38_plugin.dispatch.choose`), ``method "dflash"`` is served: the portable
model hands the DFlash drafter its auxiliary hidden states reduced by `hc_mean` (dflash2 refuses a
drafter that does not declare it). `run_stock_hook` then runs stock's hook on a shallow copy of the
config without the speculative config, so everything else stock checks and sets (on the shared
model, cache and parallel configs) still happens; where stock's model is chosen, stock's refusal
stands. Imported by `qwen38_plugin.register()` only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qwen38_plugin.dispatch import ARCHITECTURE, MM_ARCHITECTURE, choose, logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

DRAFT_MODEL_TYPE = "qwen4_exp_mtp"
# Speculative methods stock's hook refuses that the portable model serves.
PORTABLE_ONLY_METHODS = ("dflash",)


def run_stock_hook(stock_hook: Callable[[VllmConfig], None], vllm_config: VllmConfig) -> None:
    """Stock's hook, except its speculative-method refusal for a method the portable model serves
    where the portable model is chosen (see the module docstring)."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method not in PORTABLE_ONLY_METHODS or not choose(vllm_config).portable:
        stock_hook(vllm_config)
        return
    view = copy.copy(vllm_config)  # shares the model, cache and parallel configs stock updates
    view.speculative_config = None
    stock_hook(view)


def widen_draft_hidden_buffer(vllm_config: VllmConfig) -> bool:
    """Make vLLM's V1 MTP proposer size its hidden-state buffer ``hc * H`` (see the module
    docstring). True when the draft config was changed (or already was as needed)."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "mtp" or spec.draft_model_config is None:
        return False
    draft = spec.draft_model_config.hf_config
    if getattr(draft, "model_type", None) != DRAFT_MODEL_TYPE:
        return False
    text = spec.draft_model_config.hf_text_config
    hc = int(getattr(draft, "hc_mult", 0) or 0)
    if hc != int(text.hc_count):
        raise ValueError(
            f"speculative draft config: hc_mult is {hc or 'unset'}, the checkpoint's hc_count is {text.hc_count}; "
            "vLLM's MTP config override sets hc_mult = hc_count (this vLLM does not: use a supported vLLM)"
        )
    if not hasattr(draft, "compress_ratios"):
        layers = int(getattr(draft, "n_predict", None) or 1)
        draft.compress_ratios = [int(getattr(text, "indexer_compress_ratio", None) or 1)] * layers
        logger.info(
            "qwen38_plugin: MTP draft reads the target's %d residual streams: vLLM's proposer buffer is %d x %d wide",
            hc, hc, text.hidden_size,
        )  # fmt: skip
    return True


def keep_full_graphs_out_of_the_v1_runner(vllm_config: VllmConfig, on_cuda: bool | None = None) -> bool:
    """Turn full CUDA graphs off where the portable model runs in vLLM's V1 model runner on CUDA;
    True when it did.

    V1 replays its full decode graph for every batch whose requests each schedule one token, a new
    request whose whole prompt is one token included: its dispatch goes by shape alone (V2 keeps a
    batch with a prefill out of full graphs). The graph runs the recurrent layers' decode kernels as
    captured, so that request starts from whatever its state slot held instead of a zero state
    (H200, 2026-11-30: V1 with graphs 7 of 8 prompts, the one-token prompt's first token wrong;
    V1 eager and V2 with graphs 8 of 8). Piecewise graphs stay: the mixers run between them, eagerly,
    with the metadata builders' prefill / decode split. ``on_cuda`` overrides the platform check
    (for tests on a CPU machine)."""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    if not (current_platform.is_cuda() if on_cuda is None else on_cuda):
        return False
    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if (mode is not None and not mode.has_full_cudagraphs()) or vllm_config.use_v2_model_runner:
        return False
    if not choose(vllm_config).portable:
        return False
    logger.warning(
        "qwen38_plugin: the portable Qwen4Exp in vLLM's V1 model runner: cudagraph_mode %s -> PIECEWISE (V1 "
        "replays full decode graphs for one-token prompts, whose recurrent state must start at zero); use the "
        "V2 runner (the default where it runs) for full CUDA graphs",
        "default" if mode is None else mode.name,
    )
    compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
    return True


def install() -> list[str]:
    """Wrap stock's ``MODELS_CONFIG_MAP`` entries for the text and the multimodal architecture (idempotent)."""
    from vllm.model_executor.models import config as models_config

    table: dict[str, Any] = models_config.MODELS_CONFIG_MAP
    installed = []
    for architecture in (ARCHITECTURE, MM_ARCHITECTURE):
        stock = table.get(architecture)
        if stock is None:
            raise RuntimeError(
                f"this vLLM has no config hook for {architecture} (MODELS_CONFIG_MAP): qwen38_plugin expects stock "
                "vLLM's Qwen4Exp support; install a supported vLLM"
            )
        if getattr(stock, "qwen38_wraps", None) is not None:
            continue
        table[architecture] = _wrapped(stock, architecture)
        installed.append(f"{architecture} config hook (MTP draft buffer of hc * H)")
    return installed


def refuse_early(vllm_config: VllmConfig, architecture: str = ARCHITECTURE) -> None:
    """Where the dispatcher picks the portable model, its startup refusals and its GDN prefill
    choice (`vllm_startup`) run here, in the process that builds the config, before any worker
    starts; the multimodal architecture's own refusals (`vllm_mm_model.check_multimodal_config`)
    too."""
    if choose(vllm_config, architecture).portable:
        from qwen38_plugin.vllm_startup import settle_portable_config

        settle_portable_config(vllm_config)
        if architecture == MM_ARCHITECTURE:
            # (imported here: the module subclasses stock's multimodal model, a heavy import that a
            # text-only config never needs)
            from qwen38_plugin.vllm_mm_model import check_multimodal_config

            check_multimodal_config(vllm_config)


def _wrapped(stock: Any, architecture: str) -> Any:
    stock_hook = stock.verify_and_update_config

    class WrappedConfig(stock):
        qwen38_wraps = stock

        @staticmethod
        def verify_and_update_config(vllm_config: VllmConfig) -> None:
            run_stock_hook(stock_hook, vllm_config)
            refuse_early(vllm_config, architecture)
            widen_draft_hidden_buffer(vllm_config)
            keep_full_graphs_out_of_the_v1_runner(vllm_config)

    WrappedConfig.__name__ = WrappedConfig.__qualname__ = stock.__name__
    return WrappedConfig
