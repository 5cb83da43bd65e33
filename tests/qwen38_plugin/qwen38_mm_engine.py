"""Run as a script: greedy-decode multimodal requests through stock vLLM (in-process engine) and
print JSON.

Usage: qwen38_mm_engine.py MODEL PHASES_JSON [extra LLM kwargs as JSON]
PHASES_JSON is a list of phases, each a list of requests (`mm_inputs`) submitted together; the
phases run one after the other on the same engine (a later phase can hit the prefix cache an
earlier one filled). Prints one stdout line ``{"phases": [...]}``: per request its
``prompt_token_ids``, greedy ``tokens`` and their ``logprobs``, and with ``"prompt_logprobs": true``
in the request the logprob of every prompt token; per phase ``prefix_cache_hits`` (tokens vLLM
served from its prefix cache in that phase; the counter needs ``"disable_log_stats": false``); with a
``"speculative_config"`` among the kwargs, also ``spec_decode``: vLLM's draft and acceptance counters.
The engine runs in float32 unless the extra kwargs name a ``"dtype"``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository's tests package

from tests.qwen38_plugin.mm_inputs import vllm_prompt
from tests.qwen38_plugin.qwen38_engine_greedy import counter


def main() -> None:
    model, phases_json = sys.argv[1:3]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    from vllm import LLM, SamplingParams

    extra.setdefault("dtype", "float32")
    llm = LLM(model=model, seed=0, **extra)
    phases = []
    for requests in json.loads(phases_json):
        params = [
            SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, logprobs=0,
                           prompt_logprobs=0 if r.get("prompt_logprobs") else None)
            for r in requests
        ]  # fmt: skip
        hits_before = counter(llm, "vllm:prefix_cache_hits")
        outputs = llm.generate([vllm_prompt(r) for r in requests], params, use_tqdm=False)
        results: list[dict[str, Any]] = []
        for output in outputs:
            completion = output.outputs[0]
            logprobs = [
                entry[token].logprob
                for token, entry in zip(completion.token_ids, completion.logprobs or [], strict=True)
            ]
            result: dict[str, Any] = {
                "prompt_token_ids": list(output.prompt_token_ids or []),
                "tokens": list(completion.token_ids),
                "logprobs": logprobs,
            }
            if output.prompt_logprobs is not None:
                ids = list(output.prompt_token_ids or [])
                result["prompt_logprobs"] = [
                    None if entry is None else entry[token].logprob
                    for token, entry in zip(ids, output.prompt_logprobs, strict=True)
                ]
            results.append(result)
        phases.append({"requests": results, "prefix_cache_hits": counter(llm, "vllm:prefix_cache_hits") - hits_before})
    result: dict[str, Any] = {"phases": phases}
    if "speculative_config" in extra:
        result["spec_decode"] = {
            name: counter(llm, f"vllm:{name}")
            for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
