"""Run as a script: greedy-decode prompts through stock vLLM on the portable Qwen4Exp model with a
speculative proposer (the checkpoint's MTP head, or vLLM's n-gram proposer) or none, and print
JSON: the tokens and vLLM's spec-decode counters.

Usage: qwen38_engine_verify.py MODEL DTYPE STEPS PROMPTS_JSON NUM_SPECULATIVE_TOKENS [extra LLM kwargs as JSON]

The extra kwargs may hold ``"method"`` (``"mtp"``, the default, or ``"ngram"``) and
``"speculative_extra"`` (more keys of the speculative config, e.g. dflash2's ladder). The dispatcher
serves ``mtp`` only; for ``ngram`` this script lifts the refusal in its own process, so a real
engine runs the verify path with a proposer that needs no draft model. A speculative run passes
``enable_prefix_caching=False``, which the dispatcher requires on CPU with speculation.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main() -> None:
    model, dtype, steps, prompts_json, num_spec = sys.argv[1:6]
    extra: dict[str, Any] = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    from qwen38_plugin import dispatch

    refuse = dispatch._refuse_what_portable_lacks

    def refuse_all_but_ngram(target: dispatch.Target, choice: dispatch.Choice) -> None:
        if target.speculative_method != "ngram":
            refuse(target, choice)

    dispatch._refuse_what_portable_lacks = refuse_all_but_ngram
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.metrics.reader import Counter

    extra.setdefault("max_model_len", 512)
    method = extra.pop("method", "mtp")
    speculative_extra = extra.pop("speculative_extra", {})
    if int(num_spec):
        speculative: dict[str, Any] = {"method": method, "num_speculative_tokens": int(num_spec)}
        if method == "ngram":
            speculative |= {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
        speculative |= speculative_extra
        extra["speculative_config"] = speculative
        extra["enable_prefix_caching"] = False
    # token-id prompts only: without the tokenizer (stock loads and deep-copies it, ~10 s a start on 2 cores)
    extra.setdefault("skip_tokenizer_init", True)
    llm = LLM(model=model, dtype=dtype, seed=0, disable_log_stats=False, **extra)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(prompts_json)]
    params = SamplingParams(temperature=0.0, max_tokens=int(steps), ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    counters = {
        m.name.removeprefix("vllm:"): m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode") and isinstance(m, Counter)
    }
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs], "spec_decode": counters}))


if __name__ == "__main__":
    main()
