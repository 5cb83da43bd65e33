"""Which target features a DFlash drafter reads, and the `hc_mean` rule for hyper-connection targets.

A DFlash drafter conditions on the target's hidden states at the layers its
``dflash_config.target_layer_ids`` names (vLLM's auxiliary hidden states). A hyper-connection
target (Qwen3.8 Flash-Next, ``hc_count > 1``) carries ``hc_count`` residual streams per token, not
one: the drafter must say how they were reduced when it was trained. ReVolta 0.1.2's rule, kept
here: the drafter declares ``dflash_config.target_feature_reduction = "hc_mean"`` (the mean over
the streams), and startup refuses a drafter that does not, for a hyper-connection target. A
draft view (`dflash2-view`) adds the setting to a drafter's config without copying its weights.

`check_drafter` runs at startup (`dflash2.speculative_args`), before any engine process starts.
The reduction itself is the target's business (`qwen38_plugin.ops.hyper_connection.hc_mean`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REDUCTION_KEY = "target_feature_reduction"
HC_MEAN = "hc_mean"
REDUCTIONS = (HC_MEAN,)
FIELD = f"dflash_config.{REDUCTION_KEY}"


class DrafterConfigError(ValueError):
    """A drafter whose config does not fit the target; names the field, the file and the fix."""


def _get(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def hyper_connection_count(target_config: Any) -> int:
    """The target's number of residual streams (1 without hyper-connections)."""
    text = _get(target_config, "text_config") or target_config
    count = _get(text, "hc_count") or _get(text, "hc_mult") or 1
    return int(count)


def declared_reduction(draft_config: Any) -> str | None:
    dflash = _get(draft_config, "dflash_config") or {}
    value = _get(dflash, REDUCTION_KEY)
    if value is None:
        return None
    return value if isinstance(value, str) else repr(value)


def check_drafter(target_config: Any, draft_config: Any, draft_path: str = "the drafter") -> str | None:
    """Refuse a drafter whose feature reduction does not fit the target; return the reduction to apply."""
    streams = hyper_connection_count(target_config)
    reduction = declared_reduction(draft_config)
    where = f"{draft_path}/config.json"
    if reduction is not None and reduction not in REDUCTIONS:
        raise DrafterConfigError(
            f"{FIELD} = {reduction!r} in {where}: unknown reduction; the one defined is {HC_MEAN!r} "
            "(the mean over a hyper-connection target's residual streams)"
        )
    if streams > 1 and reduction != HC_MEAN:
        raise DrafterConfigError(
            f"the target has {streams} hyper-connection streams, and the DFlash drafter must declare "
            f'{FIELD} = "{HC_MEAN}" in {where} (missing). Make a draft view that adds it and links the weights: '
            f"dflash2-view {draft_path} VIEW_DIR --max-position-embeddings SERVED_CONTEXT, then pass "
            '"model": "VIEW_DIR" in --speculative-config'
        )
    if streams == 1 and reduction is not None:
        raise DrafterConfigError(
            f"{FIELD} = {reduction!r} in {where}, but the target has no hyper-connection streams to reduce: "
            "use a drafter trained for this target, or drop the setting"
        )
    return reduction
