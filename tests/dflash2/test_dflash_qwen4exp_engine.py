"""DFlash on a Qwen4Exp target through a real stock vLLM engine on CPU (the portable model).

One engine start (about half a minute on 2 cores): the tiny Qwen4Exp checkpoint in fp32 with an
lm_head of two tokens (`two_token_checkpoint`: every argmax is X or Y), a tiny random DFlash
drafter (`dflash2.tiny`) seen through a `dflash2-view` that declares
``dflash_config.target_feature_reduction = "hc_mean"``, ``num_speculative_tokens`` 4, prefix
caching off (required with speculation on CPU), five concurrent greedy requests of 1-70 prompt
tokens and 8-24 output tokens. The drafter shares the target's lm_head, so its drafts are X or Y
and some are accepted: verify steps keep several tokens and the target's GDN / PLE / QSA states
roll back to the last accepted one. The greedy tokens equal transformers' for the target alone.

The drafter itself, without the view, is refused at startup (before any engine process), naming
the field and the `dflash2-view` fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dflash2.tiny import build_tiny_drafter
from dflash2.view import make_view
from tests.engines import run_engine_script
from tests.qwen38_plugin.qwen38_reference import load_reference, reference_greedy_one
from tests.qwen38_plugin.test_qwen38_spec_verify_engine import two_token_checkpoint
from tests.qwen38_plugin.test_qwen38_vllm_engine import mixed_prompts

HERE = Path(__file__).resolve().parent
K = 4
MAX_TOKENS = [24, 8, 20, 16, 24]
EXTRA = {"enforce_eager": True, "dtype": "float32", "enable_prefix_caching": False, "max_num_seqs": 8}


def run_engine(model: Path, drafter: Path, prompts: list[list[int]]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": K}
    args = [str(model), json.dumps(spec), json.dumps(prompts), json.dumps(MAX_TOKENS), json.dumps(EXTRA)]
    cmd = [sys.executable, str(HERE / "spec_engine_run.py"), *args]
    return run_engine_script(cmd, env)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple:
    root = tmp_path_factory.mktemp("dflash_qwen4exp")
    target = two_token_checkpoint(tiny_checkpoint("qwen4_exp_text", dtype="float32"), root / "target")
    drafter = build_tiny_drafter(root / "dflash", target)
    view = make_view(drafter, root / "view", max_position_embeddings=512).path
    return target, drafter, view, mixed_prompts(2)


def test_dflash_on_qwen4exp_equals_the_target_alone(setup: tuple) -> None:
    target, _, view, prompts = setup
    proc = run_engine(target, view, prompts)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"tokens"')][-1])
    hf = load_reference(target, torch.float32)
    with torch.no_grad():
        expected = [reference_greedy_one(hf, p, n)[0] for p, n in zip(prompts, MAX_TOKENS, strict=True)]
    assert result["tokens"] == expected
    drafted = sum(sum(row) for row in result["drafted"])
    accepted = sum(sum(row) for row in result["accepted"])
    print(f"DFlash on Qwen4Exp: {accepted}/{drafted} drafts accepted", result["accepted"])
    # every verify step drafts K; some drafts are accepted (rollback past accepted tokens) and some not
    assert all(w == K for row in result["drafted"] for w in row), result["drafted"]
    assert 0 < accepted < drafted, (accepted, drafted)
    for tokens, took in zip(result["tokens"], result["accepted"], strict=True):
        # each step adds its accepted drafts + one token; the last step's are cut at max_tokens
        assert 1 + sum(a + 1 for a in took[:-1]) < len(tokens) <= 1 + sum(a + 1 for a in took), (tokens, took)


def test_drafter_without_hc_mean_is_refused_at_startup(setup: tuple) -> None:
    target, drafter, _, prompts = setup
    proc = run_engine(target, drafter, prompts[:1])
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert 'must declare dflash_config.target_feature_reduction = "hc_mean"' in log, log[-6000:]
    assert f"dflash2-view {drafter} VIEW_DIR" in log, log[-6000:]
    assert "Loading weights" not in log and "KV cache" not in log, log[-6000:]
