"""Run as a script: greedy-decode prompts through stock vLLM (in-process engine) and print JSON.

Usage: engine_greedy.py MODEL DTYPE STEPS PROMPTS_JSON [extra LLM kwargs as JSON]
Prints one stdout line {"tokens": [[...], ...]} (vLLM logs to stdout too).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    model, dtype, steps, prompts_json = sys.argv[1:5]
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=dtype, max_model_len=512, seed=0, **extra)
    prompts = json.loads(prompts_json)
    params = SamplingParams(temperature=0.0, max_tokens=int(steps), ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs]}))


if __name__ == "__main__":
    main()
