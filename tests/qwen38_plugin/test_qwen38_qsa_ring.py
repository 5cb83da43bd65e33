"""The QSA key ring and the block-size rule R38 (ReVolta 0.1.2).

- the rule as a pure function: the ring (the open group plus the speculative rows, in whole
  groups) widens by whole groups up to 4x until it divides the block size, else names the
  block-size multiple to use;
- the vLLM cache layers (`vllm_qsa_cache`) declare the widened ring in their vLLM specs, and fit
  it again when vLLM changes the block size after the model is built (a drafter's config does);
- real engine starts: a compress ratio that does not divide the CPU's default block size gets a
  block size that works (and serves transformers' tokens); an explicit block size no ring
  divides fails at startup with the rule's message; MTP with 5 drafts (a 12-token ring) starts
  and keeps the target's tokens.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from qwen38_plugin.ops import qsa
from tests.engines import IN_PROCESS, run_engine_script
from tests.qwen38_plugin.test_qwen38_vllm_engine import STEPS, mixed_prompts, reference_greedy

HERE = Path(__file__).resolve().parent

# --------------------------------------------------------------------------------------------
# The rule
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "spec_tokens", "block_size", "capacity"),
    [
        (4, 0, 128, 4),  # the base ring: the ratio itself without speculative tokens
        (4, 1, 64, 8),  # one draft row: two groups, divides as is
        (4, 1, 60, 12),  # 8 does not divide 60: one more group
        (4, 1, 100, 20),  # 8, 12, 16 do not divide 100: 20 (2.5x)
        (3, 2, 45, 9),  # 6 does not divide 45: 9
        (2, 1, 14, 14),  # 4 .. 12 do not divide 14: 14 (3.5x)
        (4, 5, 96, 12),  # five draft rows: three groups
        (2, 3, 16, 8),  # base 6 does not divide 16: 8
    ],
)
def test_ring_widens_by_whole_groups_until_it_divides(
    ratio: int, spec_tokens: int, block_size: int, capacity: int
) -> None:
    base = qsa.ring_base_capacity(ratio, spec_tokens)
    assert base % ratio == 0 and base >= ratio + spec_tokens
    got = qsa.ring_capacity(ratio, spec_tokens, block_size)
    assert got == capacity
    assert block_size % got == 0 and got % ratio == 0 and base <= got <= 4 * base
    # it is the smallest such ring
    assert all(block_size % c for c in range(base, got, ratio))


@pytest.mark.parametrize(
    ("ratio", "spec_tokens", "block_size", "multiple"),
    [
        (4, 0, 250, 4),  # not a multiple of the ratio: no ring of whole groups divides it
        (4, 1, 44, 8),  # 44 = 4 * 11: the ring would have to grow to 44 tokens (5.5x)
        (2, 1, 22, 4),  # 22 = 2 * 11: 22 would be 5.5x the base ring of 4
        (3, 0, 128, 3),  # the CPU default block size and a ratio of 3
    ],
)
def test_ring_beyond_four_times_fails_naming_the_block_multiple(
    ratio: int, spec_tokens: int, block_size: int, multiple: int
) -> None:
    with pytest.raises(qsa.RingCapacityError) as err:
        qsa.ring_capacity(ratio, spec_tokens, block_size)
    message = str(err.value)
    assert f"attention block size {block_size}" in message
    assert f"use a --block-size that is a multiple of {multiple}" in message
    # the advice works: that multiple takes the base ring as is
    assert qsa.ring_capacity(ratio, spec_tokens, multiple * 5) == qsa.ring_base_capacity(ratio, spec_tokens)


def test_default_block_size_is_a_multiple_of_the_ring() -> None:
    from qwen38_plugin.vllm_qsa_cache import default_block_size

    assert default_block_size(128, 4) == 128
    assert default_block_size(128, 3) == 384
    assert default_block_size(128, 12) == 384


# --------------------------------------------------------------------------------------------
# The vLLM cache layers with a widened ring
# --------------------------------------------------------------------------------------------


def _fake_vllm_config(path: Path, block_size: int, spec_tokens: int) -> Any:
    # Only the fields our cache layers read (not vLLM's engine: no engine runs here).
    config = AutoConfig.from_pretrained(path)
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=config, dtype=torch.float32, uses_mrope=False),
        cache_config=SimpleNamespace(block_size=block_size, user_specified_block_size=True),
        compilation_config=SimpleNamespace(static_forward_context={}),
        speculative_config=None,
        num_speculative_tokens=spec_tokens,
    )


def test_cache_layers_declare_the_widened_ring(
    tiny_checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    # ratio 4 with one speculative row: base ring 8, which does not divide the block size 60. The
    # paged ops run with such rings in tests/qwen38_plugin/test_qwen38_qsa_paged.py.
    from qwen38_plugin.vllm_qsa_cache import QSAKVCache

    path = tiny_checkpoint("qwen4_exp_text", dtype="float32")
    vllm_config = _fake_vllm_config(path, block_size=60, spec_tokens=1)
    with caplog.at_level(logging.INFO, logger="vllm.plugins.qwen38_plugin"):
        layer = QSAKVCache(vllm_config, "model.layers.3.self_attn.kv", 2)
    assert "QSA key ring widened from 8 to 12 tokens (whole 4-token groups)" in caplog.text
    assert layer.ring is not None and layer.block_keys is not None
    assert layer.ring.get_kv_cache_spec(vllm_config).block_size == 12
    keys = layer.block_keys.get_kv_cache_spec(vllm_config)
    assert (keys.block_size, keys.tokens_per_state) == (60, 4)
    assert set(vllm_config.compilation_config.static_forward_context) == {
        "model.layers.3.self_attn.kv", "model.layers.3.self_attn.kv.block_keys", "model.layers.3.self_attn.kv.key_ring",
    }  # fmt: skip


# --------------------------------------------------------------------------------------------
# Real engine starts
# --------------------------------------------------------------------------------------------


def _engine(model: Path, prompts: list[list[int]], **llm_kwargs: Any) -> tuple[int, list[list[int]] | None, str]:
    """(exit status, greedy tokens or None, the whole log) of an engine run in a subprocess."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **IN_PROCESS}
    args = [str(model), "float32", str(STEPS), json.dumps(prompts), json.dumps(llm_kwargs)]
    cmd = [sys.executable, str(HERE / "qwen38_engine_greedy.py"), *args]
    proc = run_engine_script(cmd, env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"tokens"')]
    tokens = json.loads(lines[-1])["tokens"] if lines else None
    return proc.returncode, tokens, proc.stdout + proc.stderr


def test_engine_picks_a_block_size_the_ring_divides(tiny_checkpoint: Callable[..., Path]) -> None:
    # A compress ratio of 3 does not divide the CPU platform's default block size (128): without
    # an explicit --block-size the plugin rounds the default up to 384 before vLLM fits it to the
    # mamba state pages. Prefix caching is on (the engine default), the prompts are chunked.
    # Without PLE a state slot holds 2 states, not 4: vLLM pairs them with the model's copy functions.
    model = tiny_checkpoint(
        "qwen4_exp_text",
        dtype="float32",
        overrides={"indexer_budget": 12, "indexer_compress_ratio": 3, "ple_layer_ids": []},
    )
    prompts = mixed_prompts(4)
    status, served, log = _engine(model, prompts, max_num_batched_tokens=32, max_num_seqs=8)
    assert status == 0, log[-5000:]
    assert "KV cache block size 384 (the default 128 rounded up to a multiple of the 3-token QSA key ring)" in log
    assert "kv cache group sizes (384, 384, 384, 384, 384, 3)" in log
    assert served == reference_greedy(model, prompts, torch.float32)


def test_engine_refuses_a_block_size_no_ring_divides(tiny_checkpoint: Callable[..., Path]) -> None:
    # ratio 4: 250 is not a multiple of it, so no ring of whole groups divides it.
    model = tiny_checkpoint("qwen4_exp_text", dtype="float32")
    status, served, log = _engine(model, [[1, 2, 3]], block_size=250)
    assert status != 0 and served is None
    assert "divides the attention block size 250; use a --block-size that is a multiple of 4" in log, log[-3000:]


def test_ring_is_fitted_again_when_the_block_size_changes_after_construction(
    tiny_checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    # Built at block size 384 with five draft rows (ring 12); vLLM then puts 128 back (as a V1
    # proposer's drafter config does on CPU): the ring is fitted again to 16, whole 4-token groups.
    from qwen38_plugin.vllm_qsa_cache import QSAKVCache

    path = tiny_checkpoint("qwen4_exp_text", dtype="float32")
    vllm_config = _fake_vllm_config(path, block_size=384, spec_tokens=5)
    layer = QSAKVCache(vllm_config, "model.layers.3.self_attn.kv", 2)
    assert layer.ring is not None and layer.ring.get_kv_cache_spec(vllm_config).block_size == 12
    vllm_config.cache_config.block_size = 128
    with caplog.at_level(logging.INFO, logger="vllm.plugins.qwen38_plugin"):
        assert layer.ring.get_kv_cache_spec(vllm_config).block_size == 16
    assert "QSA key ring fitted again, 12 -> 16 tokens: the attention block size became 128" in caplog.text
    # no ring of whole groups up to 4x divides 250: the rule's error names the multiple
    vllm_config.cache_config.block_size = 250
    expected = "divides the attention block size 250; use a --block-size that is a multiple of 12"
    with pytest.raises(qsa.RingCapacityError, match=expected):
        layer.ring.get_kv_cache_spec(vllm_config)


def test_engine_with_five_mtp_drafts_keeps_a_ring_that_divides_the_block_size(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    # Five draft rows make the ring 12 tokens, so the plugin rounds the CPU's default block size up to
    # 384 while the target is built; building the MTP drafter's config then puts 128 back. Before the
    # ring was fitted again at that point, the engine failed to start ("the attention block size
    # became 128, which the 12-token ring does not divide"). Greedy MTP keeps the target's tokens.
    from tests.qwen38_plugin.test_qwen38_mtp_reference import MTP

    model = tiny_checkpoint("qwen4_exp_text", dtype="float32", overrides=MTP)
    prompts = mixed_prompts(3)
    spec = {"method": "mtp", "num_speculative_tokens": 5}
    status, served, log = _engine(model, prompts, speculative_config=spec, enable_prefix_caching=False)
    assert status == 0, log[-5000:]
    assert "QSA key ring fitted again, 12 -> 16 tokens: the attention block size became 128" in log
    assert served == reference_greedy(model, prompts, torch.float32)
