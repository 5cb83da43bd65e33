"""Serve a tiny AWQ checkpoint with stock vLLM (vllm.LLM) on CPU through ``--quantization awq_sm70``.

    python awq_engine_run.py MODEL OUT.json

Writes the quantization vLLM chose, the quantization method class of every linear layer, the
attention implementation class of every attention layer, the dtype of every parameter, and for
each prompt the greedy tokens with their logprobs and the prompt logprobs (of the prompt's own
tokens). Run as a subprocess (engine processes spawn), holding an engine core (`tests.engines.engine_cores`).

On a GPU, ``SM70_ENGINE_ATTENTION_BACKEND`` names the attention backend to ask for (e.g.
``FLASH_ATTN_V100``, which vLLM picks by itself only on compute capability 7.x) and
``SM70_ENGINE_CUDA_GRAPHS=1`` leaves vLLM's CUDA graphs on (eager otherwise, as on the CPU).
"""

from __future__ import annotations

import json
import os
import sys

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:"]


def layer_methods(worker) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {
        name: type(module.quant_method).__name__
        for name, module in worker.model_runner.model.named_modules()
        if getattr(module, "quant_method", None) is not None
    }


def attention_impls(worker) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {
        name: type(module.impl).__name__
        for name, module in worker.model_runner.model.named_modules()
        if name.endswith(".attn") and getattr(module, "impl", None) is not None
    }


def parameter_dtypes(worker) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {name: str(p.dtype).removeprefix("torch.") for name, p in worker.model_runner.model.named_parameters()}


def request_results(outs) -> list[dict[str, object]]:  # type: ignore[no-untyped-def]
    """Per request: prompt ids, prompt logprobs (of the prompt's own tokens), greedy tokens and their logprobs."""
    return [
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
    ]


def main() -> None:
    from vllm import LLM, SamplingParams

    model, out_path = sys.argv[1], sys.argv[2]
    backend = os.environ.get("SM70_ENGINE_ATTENTION_BACKEND") or None
    eager = os.environ.get("SM70_ENGINE_CUDA_GRAPHS", "0") != "1"
    llm = LLM(
        model=model, quantization="awq_sm70", dtype="float16", max_model_len=128, enforce_eager=eager, seed=0,
        attention_backend=backend, skip_tokenizer_init=True,  # tokenized below, once (stock's load: ~10 s)
    )  # fmt: skip
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [TokensPrompt(prompt_token_ids=tokenizer.encode(p)) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, logprobs=1, prompt_logprobs=1))
    result = {
        "quantization": llm.llm_engine.model_config.quantization,
        "methods": llm.collective_rpc(layer_methods)[0],
        "attention_impls": llm.collective_rpc(attention_impls)[0],
        "parameters": llm.collective_rpc(parameter_dtypes)[0],
        "requests": request_results(outs),
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
