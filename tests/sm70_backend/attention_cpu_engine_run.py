"""Serve a tiny fp16 checkpoint with stock vLLM (vllm.LLM) on CPU, `FLASH_ATTN_V100` selected.

    python attention_cpu_engine_run.py MODEL OUT.json

Stock's CPU platform answers every attention backend but its own with "Cannot use ... backend on
CPU" and picks CPU_ATTN, so this script (a test's engine process, nothing else) lets it honour
``attention_backend="FLASH_ATTN_V100"``: every attention layer then runs sm70_backend's backend,
whose kernels dispatch CPU tensors to their plain-torch references (the portable path). Three
prompts together, 24 tokens per step so the longest prefills in chunks over the paged cache, then
decode. Writes the attention implementation of every layer and, per prompt, the prompt logprobs
and the greedy tokens with their logprobs (awq_engine_run.py's format).
"""

from __future__ import annotations

import json
import sys

from tests.sm70_backend.awq_engine_run import attention_impls, request_results

PROMPT_LENGTHS = (3, 17, 61)


def honour_flash_attn_v100_on_cpu() -> None:
    from vllm.platforms import cpu

    stock = cpu.CpuPlatform.get_attn_backend_cls.__func__  # type: ignore[attr-defined]

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):  # type: ignore[no-untyped-def]
        if selected_backend is not None and selected_backend.name == "FLASH_ATTN_V100":
            return selected_backend.get_path()
        return stock(cls, selected_backend, attn_selector_config, num_heads)

    cpu.CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)  # type: ignore[method-assign, assignment]


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, out_path = sys.argv[1], sys.argv[2]
    honour_flash_attn_v100_on_cpu()
    llm = LLM(
        model=model, dtype="float16", max_model_len=256, max_num_batched_tokens=24, enforce_eager=True, seed=0,
        attention_backend="FLASH_ATTN_V100", skip_tokenizer_init=True, enable_prefix_caching=False,
    )  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=[(7 * n + 11 * i) % 5000 + 10 for i in range(n)]) for n in PROMPT_LENGTHS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=1, prompt_logprobs=1))
    result = {
        "attention_impls": llm.collective_rpc(attention_impls)[0],
        "requests": request_results(outs),
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
