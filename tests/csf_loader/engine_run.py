"""Run stock vLLM (vllm.LLM) on a checkpoint; write greedy tokens, logprobs and every rank's FP4 tensors.

    python engine_run.py MODEL TP LOAD_FORMAT OUT.json [load-only] [dtype=DTYPE] [scales=no]

Run as a subprocess (engine processes spawn). Needs VLLM_ALLOW_INSECURE_SERIALIZATION=1
for the collective_rpc that reads each worker's parameters. ``load-only`` starts the
engine (weights loaded and processed, KV cache allocated) and stops before any forward;
``dtype=`` sets the model dtype (default: the checkpoint's); ``scales=no`` leaves out the
raw bytes of every ``weight_scale`` (only SHA-256 per parameter; for larger models).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def rank_tensors(worker: Any, with_scales: bool = True) -> dict[str, Any]:
    import hashlib

    import torch

    out: dict[str, Any] = {}
    for name, p in worker.model_runner.model.named_parameters():
        data = p.detach().cpu().contiguous()
        entry = {"dtype": str(data.dtype), "shape": list(data.shape)}
        raw = data.reshape(-1).view(torch.uint8)  # raw bytes, also for bf16 and empty tensors
        entry["sha256"] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
        if with_scales and name.endswith("weight_scale"):
            entry["bytes"] = raw.tolist()
        out[name] = entry
    return out


def main() -> None:
    from vllm import LLM, SamplingParams

    model, tp, load_format, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    flags = sys.argv[5:]
    load_only = "load-only" in flags
    options = dict(f.split("=", 1) for f in flags if "=" in f)
    llm = LLM(
        model=model,
        tensor_parallel_size=tp,
        load_format=load_format,
        gpu_memory_utilization=0.3,
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        dtype=options.get("dtype", "auto"),
        skip_tokenizer_init=True,  # the prompts are tokenized below, once (stock's load and copies: ~10 s)
    )
    if load_only:
        with open(out_path, "w") as f:
            json.dump({"started": True}, f)
        return
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = ("The capital of France is", "def fibonacci(n):")
    prompts = [TokensPrompt(prompt_token_ids=tokenizer.encode(text)) for text in texts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, logprobs=5))
    result = {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs] for o in outs],
        "ranks": llm.collective_rpc(rank_tensors, args=(options.get("scales") != "no",)),
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
