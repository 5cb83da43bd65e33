"""Run as a script: greedy-decode prompts through stock vLLM (in-process engine) and print JSON.

Usage: engine_greedy.py MODEL DTYPE STEPS PROMPTS_JSON [extra LLM kwargs as JSON]
Prints one stdout line {"tokens": [[...], ...]} (vLLM logs to stdout too): all prompts submitted
together. With ``"solo": true`` among the extra kwargs (not passed to vLLM) the engine first
decodes every prompt by itself, one request at a time, and the line also holds "solo" (those
tokens) and "preemptions" {"solo": n, "together": m}: vLLM's `vllm:num_preemptions` counter
over each phase (the counter needs ``"disable_log_stats": false``). With stats on, the line
also holds "prefix_cache_hits": the tokens vLLM served from its prefix cache over the whole run.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def counter(llm: Any, name: str) -> float:
    from vllm.v1.metrics.reader import Counter

    return sum(m.value for m in llm.get_metrics() if m.name == name and isinstance(m, Counter))


def preemptions(llm: Any) -> float:
    return counter(llm, "vllm:num_preemptions")


def main() -> None:
    model, dtype, steps, prompts_json = sys.argv[1:5]
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    solo = bool(extra.pop("solo", False))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra.setdefault("max_model_len", 512)
    # token-id prompts only: without the tokenizer (stock loads and deep-copies it, ~10 s a start on 2 cores)
    extra.setdefault("skip_tokenizer_init", True)
    llm = LLM(model=model, dtype=dtype, seed=0, **extra)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(prompts_json)]
    params = SamplingParams(temperature=0.0, max_tokens=int(steps), ignore_eos=True)
    result: dict[str, Any] = {}
    if solo:
        outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        result["solo"] = [list(o.outputs[0].token_ids) for o in outputs]
        after_solo = preemptions(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], **result}
    if solo:
        result["preemptions"] = {"solo": after_solo, "together": preemptions(llm) - after_solo}
    if extra.get("disable_log_stats") is False:
        result["prefix_cache_hits"] = counter(llm, "vllm:prefix_cache_hits")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
