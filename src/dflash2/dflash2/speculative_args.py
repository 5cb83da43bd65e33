"""`--speculative-config` keys stock vLLM does not have: `dflash_concurrency_drafts` (one guarded patch).

Stock's `SpeculativeConfig` forbids unknown keys (pydantic ``extra="forbid"``), and
`EngineArgs.create_speculative_config` builds it straight from the user's dict, so no registry or
config hook can add a key to ``--speculative-config``. This module wraps that one method:

- it takes `dflash_concurrency_drafts` out of the dict before stock builds `SpeculativeConfig`
  (and puts it back afterwards, so building the config twice gives the same result);
- it validates the ladder against the final `num_speculative_tokens` (`dflash2.ladder`) and writes
  it as stock's `num_speculative_tokens_per_batch_size`, which stock's scheduler, CUDA-graph
  capture and metrics then handle;
- it turns async scheduling off (the seed's rule) and refuses ``--async-scheduling``, pipeline
  or data parallelism, and a stock schedule given as well;
- it refuses `method="mtp"` on a checkpoint whose path stock would read as another method's
  (`refuse_method_taken_from_the_path`);
- with or without a ladder, it refuses `method="dflash"` with pipeline parallelism, and a DFlash
  drafter whose `dflash_config.target_feature_reduction` does not fit the target (`hc_mean` is
  required for a hyper-connection target, `dflash2.target_features`).

The wrapper is installed only after `check_stock()` finds the stock code it relies on; on any
other vLLM `install()` raises `StockChanged` naming what changed (vLLM logs a plugin that fails
to load), and tests/dflash2/test_speculative_args.py fails on it.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from dflash2.ladder import LADDER_KEY, STOCK_SCHEDULE_KEY, LadderError, check_settings, parse_ladder
from dflash2.target_features import check_drafter

logger = logging.getLogger("vllm.plugins.dflash2")

_PATCHED = "_dflash2_speculative_args"
STOCK_CALL = "SpeculativeConfig(**self.speculative_config)"
STOCK_PARAMETERS = ("self", "target_model_config", "target_parallel_config")


class StockChanged(RuntimeError):
    """The installed vLLM no longer has the code this module wraps."""


class SpeculativeSettingError(ValueError):
    """A speculative setting DFlash cannot run with; names the setting and the fix."""


def check_stock(engine_args_cls: type, speculative_config_cls: type) -> None:
    """Raise `StockChanged` unless `engine_args_cls.create_speculative_config` is the one this wraps."""
    problems = []
    method = getattr(engine_args_cls, "create_speculative_config", None)
    if method is None:
        problems.append(f"{engine_args_cls.__name__}.create_speculative_config is gone")
    else:
        method = getattr(method, "__wrapped__", method)
        parameters = tuple(inspect.signature(method).parameters)
        if parameters != STOCK_PARAMETERS:
            problems.append(f"create_speculative_config takes {parameters}, expected {STOCK_PARAMETERS}")
        try:
            source = inspect.getsource(method)
        except (OSError, TypeError):
            source = ""
        if STOCK_CALL not in source:
            problems.append(f"create_speculative_config no longer builds {STOCK_CALL}")
    fields = getattr(speculative_config_cls, "__dataclass_fields__", {})
    if STOCK_SCHEDULE_KEY not in fields:
        problems.append(f"SpeculativeConfig has no field {STOCK_SCHEDULE_KEY}")
    if LADDER_KEY in fields:
        problems.append(f"SpeculativeConfig has its own field {LADDER_KEY} now; drop this patch")
    for name in ("async_scheduling", "speculative_config"):
        if name not in getattr(engine_args_cls, "__dataclass_fields__", {}):
            problems.append(f"{engine_args_cls.__name__} has no field {name}")
    if problems:
        raise StockChanged(
            "dflash2 cannot accept dflash_concurrency_drafts on this vLLM: "
            + "; ".join(problems)
            + ". Use vLLM 0.32 or 0.33, or write the ladder as num_speculative_tokens_per_batch_size "
            "(dflash2.ladder.Ladder.stock_schedule)."
        )


def _pop_ladder(raw: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """`raw` without the ladder key (either spelling), and the removed (key, value) pairs."""
    kept, ladder = {}, []
    for key, value in raw.items():
        if isinstance(key, str) and key.replace("-", "_") == LADDER_KEY:
            ladder.append((key, value))
        else:
            kept[key] = value
    return kept, ladder


def refuse_pipeline_parallel(method: str | None, pipeline_parallel_size: int) -> None:
    if method == "dflash" and pipeline_parallel_size > 1:
        raise SpeculativeSettingError(
            f"speculative_config.method='dflash' with pipeline_parallel_size={pipeline_parallel_size}: "
            "DFlash speculative decoding does not support pipeline parallelism; use --pipeline-parallel-size 1"
        )


# Substrings stock vLLM 0.32's SpeculativeConfig looks for in the draft model's path to pick the
# method, even when the user named one: `{"method": "mtp"}` on a checkpoint under ".../dflash..."
# becomes DFlash and fails with "Model architectures ['DFlash<arch>'] are not supported".
STOCK_METHOD_PATH_HINTS = ("eagle-", "eagle3", "dflash", "dspark")


def refuse_method_taken_from_the_path(raw: Any, target_model: str) -> None:
    """Refuse `method="mtp"` where stock would read another method out of the checkpoint's path."""
    if not isinstance(raw, dict) or raw.get("method") != "mtp":
        return
    path = str(raw.get("model") or target_model)
    hints = [hint for hint in STOCK_METHOD_PATH_HINTS if hint in path.lower()]
    if hints:
        raise SpeculativeSettingError(
            f"speculative_config.method='mtp' with the checkpoint {path}: its path contains {hints[0]!r}, from "
            "which stock vLLM takes another speculative method and then fails on the MTP head; serve it from a path "
            f"without {', '.join(repr(h) for h in hints)} (a symbolic link will do)"
        )


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """`EngineArgs.create_speculative_config` that understands `dflash_concurrency_drafts`."""

    @functools.wraps(original)
    def create_speculative_config(self: Any, target_model_config: Any, target_parallel_config: Any) -> Any:
        raw = self.speculative_config
        refuse_method_taken_from_the_path(raw, str(target_model_config.model))
        ladder: list[tuple[str, Any]] = []
        if isinstance(raw, dict):
            kept, ladder = _pop_ladder(raw)
            if len(ladder) > 1:
                raise LadderError(f"speculative_config: {[key for key, _ in ladder]} name the same key; keep one")
        if ladder:
            check_settings(
                async_scheduling=self.async_scheduling,
                pipeline_parallel_size=target_parallel_config.pipeline_parallel_size,
                data_parallel_size=target_parallel_config.data_parallel_size,
                has_stock_schedule=any(
                    isinstance(key, str) and key.replace("-", "_") == STOCK_SCHEDULE_KEY for key in kept
                ),
            )
            self.speculative_config = kept
        try:
            spec = original(self, target_model_config, target_parallel_config)
        finally:
            if ladder and isinstance(self.speculative_config, dict):
                self.speculative_config[LADDER_KEY] = ladder[0][1]
        if spec is None:
            return spec
        refuse_pipeline_parallel(spec.method, target_parallel_config.pipeline_parallel_size)
        if spec.method == "dflash" and spec.draft_model_config is not None:
            check_drafter(target_model_config.hf_config, spec.draft_model_config.hf_config, str(spec.model))
        if ladder:
            parsed = parse_ladder(ladder[0][1], spec.num_speculative_tokens)
            schedule = parsed.stock_schedule()
            from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

            validate_and_normalize_dynamic_sd_schedule(schedule)  # stock's own check, before the engine
            spec.num_speculative_tokens_per_batch_size = schedule
            self.async_scheduling = False
            logger.info(
                "dflash2: %s %s -> %s=%s; async scheduling off. %s",
                LADDER_KEY,
                ladder[0][1],
                STOCK_SCHEDULE_KEY,
                schedule,
                parsed.describe(),
            )
        return spec

    setattr(create_speculative_config, _PATCHED, True)
    return create_speculative_config


def install() -> str:
    """Wrap stock's `EngineArgs.create_speculative_config` in this process (idempotent)."""
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.create_speculative_config, _PATCHED, False):
        return "already installed"
    check_stock(EngineArgs, SpeculativeConfig)
    EngineArgs.create_speculative_config = wrap(EngineArgs.create_speculative_config)  # type: ignore[method-assign]
    return "installed"
