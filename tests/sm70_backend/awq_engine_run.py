"""Serve a tiny AWQ checkpoint with stock vLLM (vllm.LLM) on CPU through ``--quantization awq_sm70``.

    python awq_engine_run.py MODEL OUT.json

Writes the quantization vLLM chose, the quantization method class of every linear layer, and
for each prompt the greedy tokens with their logprobs and the prompt logprobs (of the prompt's
own tokens). Run as a subprocess (engine processes spawn), under the shared engine lock.
"""

from __future__ import annotations

import json
import sys

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:"]


def layer_methods(worker) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {
        name: type(module.quant_method).__name__
        for name, module in worker.model_runner.model.named_modules()
        if getattr(module, "quant_method", None) is not None
    }


def main() -> None:
    from vllm import LLM, SamplingParams

    model, out_path = sys.argv[1], sys.argv[2]
    llm = LLM(model=model, quantization="awq_sm70", dtype="float16", max_model_len=128, enforce_eager=True, seed=0)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0, logprobs=1, prompt_logprobs=1))
    result = {
        "quantization": llm.llm_engine.model_config.quantization,
        "methods": llm.collective_rpc(layer_methods)[0],
        "requests": [
            {
                "prompt_ids": list(o.prompt_token_ids),
                "prompt_logprobs": [
                    None if lp is None else lp[tok].logprob
                    for tok, lp in zip(o.prompt_token_ids, o.prompt_logprobs or [], strict=False)
                ],
                "tokens": list(o.outputs[0].token_ids),
                "logprobs": [
                    lp[tok].logprob for tok, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [], strict=True)
                ],
            }
            for o in outs
        ],
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
