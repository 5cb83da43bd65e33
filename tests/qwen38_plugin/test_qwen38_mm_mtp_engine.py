"""MTP speculative decoding on the portable multimodal model (`Qwen4ExpForConditionalGeneration`)
in a real stock vLLM engine on CPU: the checkpoint's MTP head drafts from the text model's streams,
the target verifies, and greedy output equals transformers' for images, a video and text.

The checkpoint: the tiny random multimodal model of mm_checkpoint.py with a random MTP head
(`qwen38_plugin.tiny.checkpoints.add_mtp_head`) and the two-token lm_head of
test_qwen38_spec_verify_engine.py (rows X = w, Y = -w, the others 0: every greedy token, target's
or draft's, is X or Y), so drafts are accepted often and verify steps keep several tokens while the
GDN / PLE / QSA states roll back. Under M-RoPE the head's QSA layer rotates each complete group's
compressed key at its first token's (T, H, W) positions, which it keeps beside its raw keys.

One engine (in process, 64 tokens a step: images and the video span several prefill steps next to
verify rows), `num_speculative_tokens` 3, prefix caching off (required with speculation on CPU).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from qwen38_plugin.tiny.checkpoints import add_mtp_head
from tests.engines import IN_PROCESS, run_engine_script
from tests.qwen38_plugin.mm_checkpoint import mm_model_checkpoint
from tests.qwen38_plugin.mm_inputs import IMAGE, VIDEO, hf_reference
from tests.qwen38_plugin.test_qwen38_spec_verify_engine import TWO_TOKENS, two_token_checkpoint

HERE = Path(__file__).resolve().parent
STEPS = 12
REQUESTS: list[dict[str, Any]] = [
    {"text": f"Look {IMAGE} and {VIDEO} ok", "images": [[300, 200, 1]], "video": [4, 96, 128, 2], "max_tokens": STEPS},
    {"text": f"Compare {IMAGE} with {IMAGE} please", "images": [[256, 320, 4], [400, 260, 5]], "video": None,
     "max_tokens": STEPS},
    {"text": "Only words here, no pictures at all", "images": [], "video": None, "max_tokens": STEPS},
]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mm_mtp")
    with_head = root / "with-head"
    shutil.copytree(mm_model_checkpoint(), with_head)
    add_mtp_head(with_head)
    return two_token_checkpoint(with_head, root / "model")


def test_mtp_on_the_multimodal_model_keeps_greedy_output(model: Path) -> None:
    llm_kwargs = {"max_model_len": 1024, "max_num_batched_tokens": 64, "max_num_seqs": 4,
                  "enable_prefix_caching": False, "disable_log_stats": False,
                  "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **IN_PROCESS}
    args = [str(model), json.dumps([REQUESTS]), json.dumps(llm_kwargs)]
    cmd = [sys.executable, str(HERE / "qwen38_mm_engine.py"), *args]
    proc = run_engine_script(cmd, env, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    assert "Qwen4ExpForConditionalGeneration: portable (qwen38_plugin) implementation (CPU platform)" in log
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"phases"')][-1])
    served = result["phases"][0]["requests"]
    reference = hf_reference(model, REQUESTS)
    for ours, theirs in zip(served, reference, strict=True):
        assert ours["prompt_token_ids"] == theirs["prompt_token_ids"]
        assert ours["tokens"] == theirs["tokens"]
    assert {t for r in served for t in r["tokens"]} == set(TWO_TOKENS)  # both tokens occur: the sign varies
    counters = result["spec_decode"]
    print(f"MTP on the multimodal model: {counters}")
    # drafts were verified, and accepted often (several tokens per verify step: states rolled back)
    assert counters["spec_decode_num_accepted_tokens"] >= 10
    assert counters["spec_decode_num_accepted_tokens"] > 0.2 * counters["spec_decode_num_draft_tokens"]
