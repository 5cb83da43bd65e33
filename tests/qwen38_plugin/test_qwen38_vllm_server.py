"""`vllm serve` (stock vLLM's OpenAI server, CPU) with the plugin: concurrent greedy
completions equal transformers' greedy tokens, and a multi-turn conversation whose second turn
hits the prefix cache produces the same tokens as a cold (uncached) run."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines import engine_cores
from tests.qwen38_plugin.test_qwen38_vllm_engine import STEPS, mixed_prompts, reference_greedy


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Callable[..., Path], start_server: Callable[..., Any]) -> Iterator[tuple[Path, Any]]:
    model = tiny_checkpoint("qwen4_exp_text", dtype="float32")
    with engine_cores():
        # A small step budget splits the long prompts into chunks; prefix caching is on by default.
        server = start_server(
            model,
            [
                "--dtype",
                "float32",
                "--max-model-len",
                "512",
                "--max-num-batched-tokens",
                "32",
                "--enable-prefix-caching",
            ],
        )
        try:
            yield model, server
        finally:
            server.stop()


def _complete(base_url: str, model: Path, prompt: list[int]) -> list[int]:
    body = {"model": str(model), "prompt": prompt, "max_tokens": STEPS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        choice = json.loads(response.read())["choices"][0]
    return list(choice["token_ids"])


def _metric(base_url: str, name: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_concurrent_requests_equal_transformers(served: tuple[Path, Any]) -> None:
    # Ten requests of 1 to 70 tokens at once (two with an EOS token inside the prompt), the long
    # ones prefilled in chunks of the 32-token step budget.
    model, server = served
    prompts = mixed_prompts(0) + mixed_prompts(1)
    with ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(lambda p: _complete(server.base_url, model, p), prompts))
    assert outputs == reference_greedy(model, prompts, torch.float32), server.log()[-3000:]
    # ... computed with vLLM's layers and their CPU kernels, the PLE tables in host memory, as the
    # startup log says
    log = server.log()
    assert "Using CPUUnquantizedExperts MoE backend" in log
    assert re.search(r"portable Qwen4Exp weights: [\d.]+ MiB on cpu; PLE tables: [\d.]+ MiB in host memory", log)


def test_multi_turn_prefix_cache_hit_equals_cold_run(served: tuple[Path, Any]) -> None:
    model, server = served
    gen = torch.Generator().manual_seed(5)
    turn1 = torch.randint(0, 248_000, (150,), generator=gen).tolist()
    answer1 = _complete(server.base_url, model, turn1)
    turn2 = turn1 + answer1 + torch.randint(0, 248_000, (20,), generator=gen).tolist()
    hits_before = _metric(server.base_url, "vllm:prefix_cache_hits_total")
    answer2 = _complete(server.base_url, model, turn2)
    hits = _metric(server.base_url, "vllm:prefix_cache_hits_total") - hits_before
    assert hits > 0, "the second turn did not hit the prefix cache"
    # the cold run: transformers on the whole second-turn prompt, no cache at all
    assert answer2 == reference_greedy(model, [turn2], torch.float32)[0]
