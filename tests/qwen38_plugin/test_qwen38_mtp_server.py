"""MTP and DFlash speculative decoding through stock vLLM's OpenAI server on CPU are lossless:
greedy tokens equal the server's without speculation, sampled tokens follow the target's exact
distribution, and /metrics counts the accepted drafts.

The checkpoint: the tiny Qwen4Exp target with its MTP head (``mtp_num_hidden_layers`` 1), lm_head
rows X = w, Y = -w, every other row 0 (`two_token_checkpoint`, shared by target and head): every
greedy token, target's or draft's, is X or Y, decided by the sign of the final hidden state's
projection on w, so the head's drafts are accepted often. ``w`` is scaled by 0.5 so that with
``allowed_token_ids`` [X, Y] at temperature 1 the target's distribution is spread over the two
(P(X) = sigmoid(2 w . h), between about 0.1 and 0.9 on the prompt sampled here).

Two servers, one after the other (each runs its whole workload once, then stops; the tests read
the results): MTP, ``{"method": "mtp", "num_speculative_tokens": 3}`` with dflash2's concurrency
ladder (``dflash_concurrency_drafts``: stock's per-batch-size schedule, which stock's scheduler
applies to any proposer, MTP included; here 1 scheduled request verifies 3 drafts, 2-4 verify 2,
5-7 verify 1 and 8 or more verify 3 again, so the greedy requests change width as they finish and
the sampling batches verify all 3), and a DFlash drafter (dflash2's tiny random drafter through a
``dflash2-view`` with ``hc_mean``, 3 drafts; its drafts share the target's lm_head, so they are X
or Y and some are accepted) at ``--tensor-parallel-size 2``: the target's heads and experts and the
drafter (its column-parallel ``fc``, K17) split over two ranks, a core each, so every check below
also holds for drafting and verifying at TP=2. fp32, ``--no-enable-prefix-caching`` (required with
speculation on CPU), 48-token steps so long prompts prefill in chunks next to verify rows.

- Greedy: 4 completions (token prompts of 1-70 tokens) and 3 chat completions, concurrent, 24
  tokens each: the same token ids from every server as transformers' greedy decoding of the target
  alone (no speculation) on the prompt ids each server reports (`return_token_ids`). The server
  without speculation equals transformers on this model family elsewhere
  (test_qwen38_vllm_server.py), so transformers stands in for it here and saves a server start.
- Sampling: ``N`` samples of the first ``K`` tokens of one prompt at temperature 1 (requests with
  ``n`` > 1 and fixed seeds). Every sequence of K tokens in {X, Y} has an exact probability from
  transformers (product of the target's conditionals); Pearson's chi-square of the sampled counts
  against them must stay below the ``ALPHA`` quantile. Under a correct sampler the test fails with
  probability ALPHA (stated, 1e-3); at these fixed seeds the outcome is deterministic. The test's
  power is shown on a simulation of the verify rule with the same probabilities: the correct rule
  passes, accepting every draft fails, and resampling a rejected position from the target's full
  distribution (instead of the residual) fails.
- /metrics after each speculative server's workload: drafts, draft tokens, accepted tokens and
  accepted tokens per position are consistent, and acceptance is above 0 (above 0.3 for MTP).
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from dflash2.tiny import build_tiny_drafter
from dflash2.view import make_view
from tests.engines import engine_cores
from tests.qwen38_plugin.qwen38_reference import load_reference, reference_greedy_one
from tests.qwen38_plugin.test_qwen38_spec_verify_engine import MTP, TWO_TOKENS, two_token_checkpoint
from tests.qwen38_plugin.test_qwen38_vllm_engine import mixed_prompts

STEPS = 24
NUM_SPEC = 3
K = 5  # sampled tokens per sample: the prefill's token, then a verify step of 3 drafts + 1
N_REQUESTS, N_PER_REQUEST = 8, 64  # N = 512 samples per speculative server
ALPHA = 1e-3
SCALE = 0.5
LADDER = {"2": 2, "5": 1, "8": 3}  # scheduled requests: 1 verifies 3 drafts, 2-4: 2, 5-7: 1, 8 or more: 3
CONFIGS: dict[str, list[str]] = {
    "mtp": [
        "--speculative-config",
        json.dumps({"method": "mtp", "num_speculative_tokens": NUM_SPEC, "dflash_concurrency_drafts": LADDER}),
    ],
}
SERVERS = ("mtp", "dflash")
CHATS = ["Hello, how are you?", "Write a haiku about the sea.", "1 2 3 4 5 6 7 8 9"]
SAMPLE_PROMPT = list(range(3_000, 3_012))


def chi2_sf(statistic: float, df: int) -> float:
    """P(chi-square with ``df`` degrees of freedom > statistic)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


@functools.cache
def chi2_quantile(alpha: float, df: int) -> float:
    """The statistic above which a chi-square variable lies with probability ``alpha`` (bisection)."""
    low, high = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if chi2_sf(mid, df) > alpha else (low, mid)
    return high


def pearson(counts: Counter[tuple[int, ...]], probs: dict[tuple[int, ...], float]) -> tuple[float, int]:
    """Pearson's statistic over the sequences, cells with an expected count below 5 pooled; and its df."""
    total = sum(counts.values())
    assert set(counts) <= set(probs), f"sampled sequences outside the support: {set(counts) - set(probs)}"
    cells: list[tuple[float, int]] = []
    pooled_p, pooled_n = 0.0, 0
    for seq, p in probs.items():
        if p * total < 5:
            pooled_p, pooled_n = pooled_p + p, pooled_n + counts[seq]
        else:
            cells.append((p, counts[seq]))
    if pooled_p > 0:
        cells.append((pooled_p, pooled_n))
    statistic = sum((n - p * total) ** 2 / (p * total) for p, n in cells)
    return statistic, len(cells) - 1


def exact_probabilities(model: Path, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(first K tokens = seq) for every seq in {X, Y}^K, the target restricted to X and Y at temperature 1."""
    hf = load_reference(model, torch.float32)
    probs = {}
    with torch.no_grad():
        for prefix in itertools.product(TWO_TOKENS, repeat=K - 1):
            logits = hf(torch.tensor([prompt + list(prefix)])).logits[0, len(prompt) - 1 :, list(TWO_TOKENS)]
            conditional = torch.softmax(logits.double(), -1)  # [K, 2]
            for last in TWO_TOKENS:
                seq = (*prefix, last)
                probs[seq] = float(
                    torch.prod(torch.stack([conditional[i, TWO_TOKENS.index(t)] for i, t in enumerate(seq)]))
                )
    return probs


class Results:
    """Each configuration's outputs, computed once: its server starts, serves everything, stops."""

    def __init__(
        self,
        model: Path,
        start_server: Callable[..., Any],
        configs: dict[str, list[str]],
        dtype: str = "float32",
        hold_cores: bool = True,
    ) -> None:
        """``hold_cores``: each server holds a CPU core per rank while it runs (``engine_cores``); off on a GPU."""
        self.model, self.start_server, self.configs = model, start_server, configs
        self.dtype, self.hold_cores = dtype, hold_cores
        self.cache: dict[str, dict[str, Any]] = {}

    def __call__(self, name: str) -> dict[str, Any]:
        if name not in self.cache:
            self.cache[name] = self._serve(name)
        return self.cache[name]

    def _serve(self, name: str) -> dict[str, Any]:
        args = ["--dtype", self.dtype, "--max-model-len", "512", "--max-num-batched-tokens", "48", "--seed", "0",
                "--no-enable-prefix-caching", *self.configs[name]]  # fmt: skip
        if not self.hold_cores:
            return self._serve_on_cores(name, args)
        ranks = int(args[args.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in args else 1
        with engine_cores(ranks):  # a core for each rank, held while this server runs
            return self._serve_on_cores(name, args)

    def _serve_on_cores(self, name: str, args: list[str]) -> dict[str, Any]:
        started = time.monotonic()
        server = self.start_server(self.model, args)
        startup = time.monotonic() - started
        try:
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=600)
            started = time.monotonic()
            greedy = self._greedy(client)
            greedy_s = time.monotonic() - started
            started = time.monotonic()
            samples = self._samples(client)
            sampling_s = time.monotonic() - started
            with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30) as response:
                metrics = response.read().decode()
            log = server.log()
        finally:
            server.stop()
        print(f"{name}: startup {startup:.0f} s, greedy {greedy_s:.0f} s, sampling {sampling_s:.0f} s")
        return {"greedy": greedy, "samples": samples, "metrics": metrics, "log": log}

    def _greedy(self, client: openai.OpenAI) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, completion ids) of each greedy request, as the server reports them."""
        model = str(self.model)
        extra = {"ignore_eos": True, "return_token_ids": True}

        def complete(prompt: list[int]) -> tuple[list[int], list[int]]:
            out = client.completions.create(model=model, prompt=prompt, max_tokens=STEPS, temperature=0.0,
                                            extra_body=extra)  # fmt: skip
            choice: Any = out.choices[0]
            return list(choice.prompt_token_ids), list(choice.token_ids)

        def chat(text: str) -> tuple[list[int], list[int]]:
            out: Any = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": text}], max_tokens=STEPS, temperature=0.0,
                extra_body=extra,
            )  # fmt: skip
            return list(out.prompt_token_ids), list(out.choices[0].token_ids)

        prompts = mixed_prompts(2)[1:]
        jobs: list[Callable[[], tuple[list[int], list[int]]]] = [lambda p=p: complete(p) for p in prompts]
        jobs += [lambda t=t: chat(t) for t in CHATS]
        with ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(lambda job: job(), jobs))

    def _samples(self, client: openai.OpenAI) -> list[tuple[int, ...]]:
        def sample(seed: int) -> list[tuple[int, ...]]:
            out = client.completions.create(
                model=str(self.model), prompt=SAMPLE_PROMPT, max_tokens=K, temperature=1.0, n=N_PER_REQUEST,
                seed=seed,
                extra_body={"ignore_eos": True, "return_token_ids": True, "allowed_token_ids": list(TWO_TOKENS)},
            )  # fmt: skip
            return [tuple(choice.token_ids) for choice in out.choices]  # type: ignore[attr-defined]

        with ThreadPoolExecutor(4) as pool:
            return [s for batch in pool.map(sample, range(0, N_REQUESTS * 1000, 1000)) for s in batch]


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tiny_checkpoint("qwen4_exp_text", overrides=MTP, dtype="float32")
    return two_token_checkpoint(source, tmp_path_factory.mktemp("mtp-server") / "model", scale=SCALE)


@pytest.fixture(scope="module")
def dflash_view(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dflash-server")
    return make_view(build_tiny_drafter(root / "dflash", model), root / "view", max_position_embeddings=512).path


@pytest.fixture(scope="module")
def results(model: Path, dflash_view: Path, start_server: Callable[..., Any]) -> Iterator[Results]:
    dflash = {"method": "dflash", "model": str(dflash_view), "num_speculative_tokens": NUM_SPEC}
    configs = {**CONFIGS, "dflash": ["--speculative-config", json.dumps(dflash), "--tensor-parallel-size", "2"]}
    yield Results(model, start_server, configs)


@pytest.fixture(scope="module")
def probs(model: Path) -> dict[tuple[int, ...], float]:
    return exact_probabilities(model, SAMPLE_PROMPT)


def spec_counters(metrics: str) -> dict[str, float]:
    counters: dict[str, float] = {}
    for line in metrics.splitlines():
        match = re.match(r"vllm:(spec_decode_\w+)_total(\{[^}]*\})? ([0-9.e+]+)$", line)
        if match:
            name, labels, value = match.groups()
            position = re.search(r'position="(\d+)"', labels or "")
            key = f"{name}[{position.group(1)}]" if position else name
            counters[key] = counters.get(key, 0.0) + float(value)
    return counters


@pytest.fixture(scope="module")
def no_speculation(model: Path) -> Callable[[list[int]], list[int]]:
    """transformers' greedy tokens for the target alone, per prompt (memoized)."""
    hf = load_reference(model, torch.float32)
    memo: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in memo:
            with torch.no_grad():
                memo[tuple(prompt)] = reference_greedy_one(hf, prompt, STEPS)[0]
        return memo[tuple(prompt)]

    return greedy


@pytest.mark.parametrize("name", SERVERS)
def test_greedy_tokens_equal_the_target_without_speculation(
    results: Results, no_speculation: Callable[[list[int]], list[int]], name: str
) -> None:
    served = results(name)["greedy"]
    prompts = [prompt for prompt, _ in served]
    assert prompts[: len(mixed_prompts(2)) - 1] == mixed_prompts(2)[1:]  # the completions' prompts, as sent
    expected = [no_speculation(prompt) for prompt in prompts]
    assert {t for row in expected for t in row} == set(TWO_TOKENS)  # both tokens occur: the sign varies
    assert [tokens for _, tokens in served] == expected


def test_sampling_follows_the_target_distribution(results: Results, probs: dict[tuple[int, ...], float]) -> None:
    for name in SERVERS:
        samples = results(name)["samples"]
        assert len(samples) == N_REQUESTS * N_PER_REQUEST
        statistic, df = pearson(Counter(samples), probs)
        threshold = chi2_quantile(ALPHA, df)
        p_value = chi2_sf(statistic, df)
        print(f"{name}: chi-square {statistic:.1f} on {df} df, threshold {threshold:.1f} (p = {p_value:.3f})")
        assert statistic < threshold, name


def simulate(
    probs: dict[tuple[int, ...], float], runs: int, n: int, rule: str, gen: torch.Generator
) -> list[Counter[tuple[int, ...]]]:
    """``runs`` simulated runs of ``n`` samples of K tokens each (all drawn at once): the first token
    from the target, then one verify step of K - 1 drafts (each the target's most likely token after
    the drafts before it: a perfect greedy drafter), decided by ``rule``: "correct" (accept with
    p(draft), else take the residual, which over two tokens is the other one; later positions from
    the target), "accept all", or "resample" (a rejected position sampled from the full p, the
    classic bug)."""
    x = TWO_TOKENS[0]

    def p_x(prefix: tuple[int, ...]) -> float:  # P(X | prefix)
        depth = len(prefix)
        joint = sum(p for seq, p in probs.items() if seq[:depth] == prefix)
        return sum(p for seq, p in probs.items() if seq[: depth + 1] == (*prefix, x)) / joint

    # P(X | prefix) for every prefix, indexed by (length, prefix as bits: 1 = X, first token highest)
    table = torch.zeros(K, 2 ** (K - 1), dtype=torch.float64)
    for length in range(K):
        for bits in itertools.product((1, 0), repeat=length):
            code = int("".join(map(str, bits)) or "0", 2)
            table[length, code] = p_x(tuple(x if b else TWO_TOKENS[1] for b in bits))
    total = runs * n
    code = (torch.rand(total, generator=gen, dtype=torch.float64) < table[0, 0]).long()
    rejected = torch.zeros(total, dtype=torch.bool)
    for position in range(1, K):
        p = table[position, code]
        drawn = torch.rand(total, generator=gen, dtype=torch.float64) < p  # from the target
        draft_is_x = p >= 0.5
        p_draft = torch.where(draft_is_x, p, 1 - p)
        accept = torch.rand(total, generator=gen, dtype=torch.float64) < p_draft
        if rule == "accept all":
            accept[:] = True
        verifying = ~rejected
        on_reject = ~draft_is_x if rule == "correct" else drawn
        is_x = torch.where(verifying, torch.where(accept, draft_is_x, on_reject), drawn)
        rejected |= verifying & ~accept
        code = code * 2 + is_x.long()
    counts = torch.bincount((code.view(runs, n) + torch.arange(runs)[:, None] * 2**K).flatten(), minlength=runs * 2**K)
    sequences = [tuple(x if (c >> (K - 1 - i)) & 1 else TWO_TOKENS[1] for i in range(K)) for c in range(2**K)]
    return [
        Counter({seq: int(c) for seq, c in zip(sequences, row.tolist(), strict=True) if c})
        for row in counts.view(runs, 2**K)
    ]


def test_the_statistical_test_has_power(probs: dict[tuple[int, ...], float]) -> None:
    # 200 simulated runs of N samples per rule: how often the chi-square test rejects
    gen = torch.Generator().manual_seed(0)
    n, runs = N_REQUESTS * N_PER_REQUEST, 200
    rejections = {}
    for rule in ("correct", "accept all", "resample"):
        rejected = 0
        for counts in simulate(probs, runs, n, rule, gen):
            statistic, df = pearson(counts, probs)
            rejected += statistic >= chi2_quantile(ALPHA, df)
        rejections[rule] = rejected / runs
    print(f"rejection rate of the test over {runs} simulated runs of {n} samples: {rejections}")
    assert rejections["correct"] <= 0.02  # ALPHA = 1e-3 (+ the chi-square approximation)
    assert rejections["accept all"] == 1.0 and rejections["resample"] >= 0.99


def metrics_checks(name: str, metrics: str, log: str) -> dict[str, Any]:
    """A speculative server's /metrics after its workload: the counters, the acceptance rate and
    each check by name (all must hold). ``name``: "mtp" (the ladder's checks too) or "dflash"."""
    counters = spec_counters(metrics)
    drafts = counters.get("spec_decode_num_drafts", 0.0)
    draft_tokens = counters.get("spec_decode_num_draft_tokens", 0.0)
    accepted = counters.get("spec_decode_num_accepted_tokens", 0.0)
    per_position = [counters.get(f"spec_decode_num_accepted_tokens_per_pos[{i}]", 0.0) for i in range(NUM_SPEC)]
    rate = accepted / draft_tokens if draft_tokens else 0.0
    checks = {
        "drafts_consistent": 0 < drafts <= draft_tokens <= NUM_SPEC * drafts,
        "accepted_consistent": 0 < accepted <= draft_tokens and sum(per_position) == accepted,
        "accepted_after_accepted": all(a >= b for a, b in itertools.pairwise(per_position)),
        # the MTP head is the target's own layer on the two-token model; the DFlash drafter is random
        "acceptance_above_floor": rate > (0.3 if name != "dflash" else 0.0),
    }
    if name == "mtp":  # the ladder: some steps verified fewer than all drafts
        checks["ladder_narrowed_some_steps"] = draft_tokens < NUM_SPEC * drafts
        checks["ladder_logged"] = "dflash2: dflash_concurrency_drafts" in log
    return {"counters": counters, "acceptance": rate, "per_position": per_position, "checks": checks}


@pytest.mark.parametrize("name", SERVERS)
def test_metrics_count_accepted_drafts(results: Results, name: str) -> None:
    report = metrics_checks(name, results(name)["metrics"], results(name)["log"])
    print(f"{name}: {report['counters']}, acceptance {report['acceptance']:.2f}")
    failed = [check for check, holds in report["checks"].items() if not holds]
    assert not failed, (failed, report["counters"])


def test_the_dflash_server_drafts_on_two_ranks(results: Results) -> None:
    # Each rank builds the drafter's fc column-parallel (K17) and the target split over both.
    log = results("dflash")["log"]
    ranks = {m.group(1) for m in re.finditer(r"\(\S*?TP(\d) pid=\d+\).*column-parallel over 2 ranks", log)}
    assert ranks == {"0", "1"}, log[-4000:]
