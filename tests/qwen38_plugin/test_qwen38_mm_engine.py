"""Stock vLLM (CPU, `vllm.LLM`) serving a tiny random `Qwen4ExpForConditionalGeneration` through the
portable multimodal model: images and a short video give transformers' fp32 logprobs (within
1e-4 relative; measured 3e-7) and greedy tokens, with several requests at once, a step budget
that splits images and the video over prefill steps, and a prefix-cache hit that ends inside a
video.

One engine (in process), two phases:
1. four requests together, 64 tokens per step: an image and a 4-frame video (165 tokens: the
   image's 70 tokens span steps 1-2, the video's 2 x 35 steps 2-3); the same with another image;
   two images of other sizes; text only. Each prompt token's logprob (vLLM's prompt logprobs)
   and 8 greedy tokens with their logprobs against transformers' forward on the whole sequence
   (no cache: a cold run per step).
2. the first prompt plus more text: vLLM serves its first 128 tokens (one block, which ends inside
   the video) from the prefix cache and re-encodes the video for the rest; the tokens and
   logprobs are again transformers' cold run's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.engines import IN_PROCESS, run_engine_script
from tests.qwen38_plugin.mm_checkpoint import mm_model_checkpoint
from tests.qwen38_plugin.mm_inputs import IMAGE, VIDEO, hf_reference

HERE = Path(__file__).resolve().parent
STEPS = 8
BUDGET = 64  # tokens per step: smaller than an image

IMAGE_AND_VIDEO = f"Look {IMAGE} and {VIDEO} ok"
PHASE1: list[dict[str, Any]] = [
    {"text": IMAGE_AND_VIDEO, "images": [[300, 200, 1]], "video": [4, 96, 128, 2], "max_tokens": STEPS,
     "prompt_logprobs": True},
    {"text": IMAGE_AND_VIDEO, "images": [[300, 200, 3]], "video": [4, 96, 128, 2], "max_tokens": STEPS,
     "prompt_logprobs": True},
    {"text": f"Compare {IMAGE} with {IMAGE} please", "images": [[256, 320, 4], [400, 260, 5]], "video": None,
     "max_tokens": STEPS, "prompt_logprobs": True},
    {"text": "Only words here, no pictures at all, and a few more of them", "images": [], "video": None,
     "max_tokens": STEPS, "prompt_logprobs": True},
]  # fmt: skip
PHASE2: list[dict[str, Any]] = [
    {**PHASE1[0], "text": IMAGE_AND_VIDEO + " and now tell me more about both of them, in detail",
     "prompt_logprobs": False},
]  # fmt: skip


def rel_err(actual: list[float], expected: list[float]) -> float:
    """max |actual - expected| / max |expected|."""
    return max(abs(a - b) for a, b in zip(actual, expected, strict=True)) / max(abs(b) for b in expected)


@pytest.fixture(scope="module")
def served() -> list[dict[str, Any]]:
    model = mm_model_checkpoint()
    llm_kwargs = {"max_model_len": 1024, "max_num_batched_tokens": BUDGET, "max_num_seqs": 4,
                  "enable_prefix_caching": True, "disable_log_stats": False}  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **IN_PROCESS}
    args = [str(model), json.dumps([PHASE1, PHASE2]), json.dumps(llm_kwargs)]
    cmd = [sys.executable, str(HERE / "qwen38_mm_engine.py"), *args]
    proc = run_engine_script(cmd, env, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    assert "Qwen4ExpForConditionalGeneration: portable (qwen38_plugin) implementation (CPU platform)" in log
    phases: list[dict[str, Any]] = json.loads(
        [line for line in proc.stdout.splitlines() if line.startswith('{"phases"')][-1]
    )["phases"]
    return phases


def test_images_and_video_follow_transformers(served: list[dict[str, Any]]) -> None:
    reference = hf_reference(mm_model_checkpoint(), PHASE1)
    requests = served[0]["requests"]
    for ours, theirs in zip(requests, reference, strict=True):
        assert ours["prompt_token_ids"] == theirs["prompt_token_ids"]  # stock's processor = transformers'
        assert ours["tokens"] == theirs["tokens"]
        errors = (
            rel_err(ours["prompt_logprobs"][1:], theirs["prompt_logprobs"][1:]),
            rel_err(ours["logprobs"], theirs["logprobs"]),
        )
        print(f"{len(ours['prompt_token_ids'])}-token prompt: prompt / output logprobs max rel error {errors}")
        assert max(errors) < 1e-4, errors
    # the image is seen: another image changes the logprobs from its second token on (its first
    # token's own output already differs, but transformers' vision features then feed every later one)
    first_image = requests[0]["prompt_token_ids"].index(248056)
    after = slice(first_image + 2, None)
    assert rel_err(requests[1]["prompt_logprobs"][after], requests[0]["prompt_logprobs"][after]) > 1e-3
    # the prompts were prefilled in several steps, an image split between two
    assert len(requests[0]["prompt_token_ids"]) == 165 > 2 * BUDGET


def test_prefix_cache_hit_inside_a_video_equals_cold_run(served: list[dict[str, Any]]) -> None:
    (ours,) = served[1]["requests"]
    assert served[1]["prefix_cache_hits"] >= 128, served[1]
    # the cached block ends inside the video's placeholder tokens
    video = [i for i, t in enumerate(ours["prompt_token_ids"]) if t == 248057]
    assert video[0] < served[1]["prefix_cache_hits"] <= video[-1]
    (theirs,) = hf_reference(mm_model_checkpoint(), PHASE2)
    assert ours["prompt_token_ids"] == theirs["prompt_token_ids"]
    assert ours["tokens"] == theirs["tokens"]
    error = rel_err(ours["logprobs"], theirs["logprobs"])
    print(f"after a {served[1]['prefix_cache_hits']}-token prefix-cache hit: output logprobs max rel error {error}")
    assert error < 1e-4, error
