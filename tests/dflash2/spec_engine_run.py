"""Run as a script: greedy-decode prompts with speculative decoding in stock vLLM; print JSON.

Usage: spec_engine_run.py MODEL SPECULATIVE_CONFIG_JSON PROMPTS_JSON MAX_TOKENS_JSON [LLM kwargs JSON]
(SPECULATIVE_CONFIG_JSON ``null``: no speculation, the same run without it.)

All prompts (token ids) are submitted together, request i with greedy sampling, `ignore_eos` and
MAX_TOKENS[i] tokens. ``"lift_gpu_dflash_refusal": true`` among the LLM kwargs (not passed to vLLM)
lifts the portable model's refusal of DFlash in vLLM's V1 runner on a GPU in this process (for the
GPU session's study of it); ``"count_adaptive_verification": true`` (not passed to vLLM either) counts, per
engine step, the drafts scheduled and the drafts stock's adaptive verification lets through to the
target (Model Runner V2, GPU only), and adds ``"adaptive": {"steps", "scheduled", "verified",
"longest_idle"}`` to the printed line (``longest_idle``: the most steps in a row that scheduled drafts
and verified none); ``"logprobs": N`` (not passed to vLLM either) asks each request for its top N
logprobs and adds ``"margins"``: per request, per token, the gap between the two largest. The engine
core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so all requests are queued before its first step, and every step's `SchedulerOutput` (what the
target runs and verifies) is recorded as it leaves stock's scheduler.

Prints one stdout line {"tokens", "drafted", "accepted", "steps"}: per request its tokens and, from
vLLM's per-request metrics (``per_request_spec_decode_metrics="detailed"``), the drafts verified
and accepted at each of its verify steps; per engine step the number of requests scheduled, the
drafts scheduled for verification per request (in request order) and the number of drafts the
scheduler asks the drafter for (`num_spec_tokens_to_schedule`).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def lift_gpu_dflash_refusal() -> None:
    """In this process only (engine core included): let the portable model verify a DFlash drafter in vLLM's
    V1 model runner on a GPU, which its dispatcher refuses (no draft accepted there), so that a GPU session
    can study it."""
    import dataclasses

    from qwen38_plugin import dispatch

    refuse = dispatch._refuse_what_portable_lacks

    def refuse_but_gpu_dflash(target: dispatch.Target, choice: dispatch.Choice) -> None:
        refuse(dataclasses.replace(target, platform="cpu") if target.speculative_method == "dflash" else target, choice)

    dispatch._refuse_what_portable_lacks = refuse_but_gpu_dflash


def count_adaptive_verification() -> dict[str, int]:
    """Totals of stock's adaptive verification in this process: each step's scheduled drafts and its
    draft budget (the drafts the target verifies), read from the budget that
    ``AdaptiveVerificationManager.get_num_tokens`` stashes for ``reallocate_drafts`` (vLLM 0.32's
    Model Runner V2); a vLLM without them fails here, naming what is missing."""
    from vllm.v1.worker.gpu.spec_decode.adaptive_verification import AdaptiveVerificationManager

    reallocate = getattr(AdaptiveVerificationManager, "reallocate_drafts", None)
    if reallocate is None:
        raise SystemExit("count_adaptive_verification: no AdaptiveVerificationManager.reallocate_drafts in this vLLM")
    totals = {"steps": 0, "scheduled": 0, "verified": 0, "longest_idle": 0}
    idle = 0  # steps in a row that scheduled drafts and verified none

    def counting_reallocate(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal idle
        budget = getattr(self, "_batch_budget", None)
        if not (isinstance(budget, tuple) and len(budget) == 3 and isinstance(budget[0], dict)):
            raise SystemExit(f"count_adaptive_verification: unexpected _batch_budget {budget!r} in this vLLM")
        scheduled, verified = sum(budget[0].values()), int(budget[2])
        totals["steps"] += 1
        totals["scheduled"] += scheduled
        totals["verified"] += verified
        idle = idle + 1 if scheduled and not verified else 0
        totals["longest_idle"] = max(totals["longest_idle"], idle)
        return reallocate(self, *args, **kwargs)

    AdaptiveVerificationManager.reallocate_drafts = counting_reallocate  # type: ignore[method-assign]
    return totals


def main() -> None:
    model, spec_json, prompts_json, max_tokens_json = sys.argv[1:5]
    extra: dict[str, Any] = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if extra.pop("lift_gpu_dflash_refusal", False):
        lift_gpu_dflash_refusal()
    adaptive = count_adaptive_verification() if extra.pop("count_adaptive_verification", False) else None
    logprobs = extra.pop("logprobs", None)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra.setdefault("max_model_len", 512)
    # token-id prompts only: without the tokenizer (stock loads and deep-copies it, ~10 s a start on 2 cores)
    extra.setdefault("skip_tokenizer_init", True)
    spec = json.loads(spec_json)
    if spec is not None:  # (vLLM refuses per-request speculative metrics without speculation)
        extra.setdefault("per_request_spec_decode_metrics", "detailed")
    llm = LLM(model=model, seed=0, speculative_config=spec, **extra)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule
    steps: list[dict[str, Any]] = []
    request_order: list[str] = []

    def recording_schedule(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        if output.num_scheduled_tokens:
            for req_id in output.num_scheduled_tokens:
                if req_id not in request_order:
                    request_order.append(req_id)
            spec = output.scheduled_spec_decode_tokens
            steps.append(
                {
                    "scheduled": len(output.num_scheduled_tokens),
                    "verified": [
                        len(spec.get(r, [])) if r in output.num_scheduled_tokens else None for r in request_order
                    ],
                    "next_drafts": output.num_spec_tokens_to_schedule,
                }
            )
        return output

    scheduler.schedule = recording_schedule
    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(prompts_json)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=logprobs)
        for m in json.loads(max_tokens_json)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result: dict[str, Any] = {"tokens": [], "drafted": [], "accepted": [], "steps": steps}
    for output in outputs:
        completion = output.outputs[0]
        metrics = completion.spec_decode_metrics
        result["tokens"].append(list(completion.token_ids))
        result["drafted"].append(list(metrics.per_step_drafted) if metrics else [])
        result["accepted"].append(list(metrics.per_step_accepted) if metrics else [])
        if logprobs:
            tops = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in completion.logprobs or []]
            result.setdefault("margins", []).append([top[0] - top[1] if len(top) > 1 else None for top in tops])
    if adaptive is not None:
        result["adaptive"] = adaptive
    print(json.dumps(result))


if __name__ == "__main__":
    main()
