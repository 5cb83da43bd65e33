"""PLE's Triton path inside a real vLLM engine on CPU (``TRITON_INTERPRET=1``), call by call
against its torch ops: a debugging run, not a test (the interpreter makes it minutes long).

    TRITON_INTERPRET=1 .venv/bin/python tests/engines.py .venv/bin/python \\
        tests/qwen38_plugin/ple_triton_engine_check.py WORK_DIR [--drafts 4]

The tiny Qwen4Exp with an MTP head and the two-token lm_head of test_qwen38_spec_verify_engine.py
(drafts are accepted about half the time, so verify steps keep 2-5 tokens and the next step
reads the slot of the last kept token), five concurrent requests whose chunked prefills share
steps with verify rows. Every call of `ple_varlen.ngram_rows_varlen` and `ple_varlen.ple_mix_varlen`
the engine makes runs the torch ops on copies of the state caches, then the Triton kernels on
the real ones, and compares the outputs and every slot of both caches; the engine goes on with
the Triton path's results. vLLM hands the ops its real metadata: a block-table column for the
read slots, the per-position write slots of speculative rows (``write_indices``), padding.
Prints one JSON line: calls with and without speculative rows, the largest differences, and the
greedy tokens against transformers'.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path)
    parser.add_argument("--drafts", type=int, default=4)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1: the Triton kernels run on CPU tensors only under the interpreter")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model runs in this process, where the patch is
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    from qwen38_plugin.ops import ple_varlen
    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint
    from tests.qwen38_plugin.test_qwen38_spec_verify_engine import MTP, STEPS, greedy_reference, two_token_checkpoint
    from tests.qwen38_plugin.test_qwen38_vllm_engine import mixed_prompts

    source = args.work / "tiny-mtp"
    if not source.exists():
        build_tiny_checkpoint(source, "qwen4_exp_text", overrides=MTP, dtype="float32")
    model = two_token_checkpoint(source, args.work / "two-token")
    prompts = mixed_prompts(2)
    stats: dict[str, Any] = {"calls": {"plain": 0, "speculative": 0}, "max_abs_diff": 0.0, "cache_mismatches": 0}

    def compared(name: str, run: Any, cache_arg: int) -> Any:
        def both(*call_args: Any, **kwargs: Any) -> Any:
            cache = call_args[cache_arg]
            saved = cache.clone()
            reference = run(*call_args, **{**kwargs, "backend": "torch"})
            after_reference = cache.clone()
            cache.copy_(saved)
            result = run(*call_args, **{**kwargs, "backend": "triton"})
            kind = "speculative" if kwargs.get("write_indices") is not None else "plain"
            stats["calls"][kind] += 1
            diff = (result.double() - reference.double()).abs().max().item() if result.numel() else 0.0
            stats["max_abs_diff"] = max(stats["max_abs_diff"], diff)
            # the same slots written (a slot is a leading index), to values equal up to the float
            # rounding of the conv inputs (the n-gram contexts are int64: equal)
            slots = tuple(range(1, saved.dim()))

            def written(after: torch.Tensor) -> torch.Tensor:
                return (after.nan_to_num() != saved.nan_to_num()).any(dim=slots) if slots else after != saved

            cache_diff = (cache.double().nan_to_num() - after_reference.double().nan_to_num()).abs().max().item()
            stats["max_cache_diff"] = max(stats.get("max_cache_diff", 0.0), cache_diff)
            stats["slots_written"] = stats.get("slots_written", 0) + int(written(after_reference).sum())
            if not torch.equal(written(cache), written(after_reference)) or cache_diff > 1e-5:
                stats["cache_mismatches"] += 1
                stats.setdefault("first_mismatch", f"{name} ({kind}): cache diff {cache_diff:.2e}")
            return result

        return both

    # positional index of each op's state cache (`ngram_rows_varlen`: context_cache; `ple_mix_varlen`: conv_state_cache)
    ple_varlen.ngram_rows_varlen = compared("ngram_rows_varlen", ple_varlen.ngram_rows_varlen, 3)
    ple_varlen.ple_mix_varlen = compared("ple_mix_varlen", ple_varlen.ple_mix_varlen, 7)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(model), dtype="float32", seed=0, max_model_len=512, skip_tokenizer_init=True,
        enable_prefix_caching=False, max_num_batched_tokens=32, max_num_seqs=8,
        speculative_config={"method": "mtp", "num_speculative_tokens": args.drafts},
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    stats["tokens_equal_transformers"] = tokens == greedy_reference(model, prompts)
    print(json.dumps(stats), flush=True)
    ok = stats["calls"]["speculative"] > 0 and stats["cache_mismatches"] == 0 and stats["tokens_equal_transformers"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
