"""dflash2.acceptance (K20): stock's online acceptance estimator collapses; the trust region and
exploration recover. Simulated serving: features, the estimator's admission, Bernoulli acceptance."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from dflash2.acceptance import INIT_BIAS, ROBUST, STOCK, AcceptanceEstimator, EstimatorSettings, draft_feature

K = 4
MIN_SURVIVAL = 0.05
NO_EXPLORATION = dataclasses.replace(ROBUST, explore_after_idle_steps=None)


def high(f: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(f + 1.0)  # the drafter is good: about 0.95 at typical features


def low(f: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(f - 10.0)  # a stretch the drafter cannot follow (long thinking)


def serve(
    est: AcceptanceEstimator, rounds: int, true_rate: Callable[[torch.Tensor], torch.Tensor], gen: torch.Generator
) -> list[tuple[float, float]]:
    """`rounds` refit intervals of 8 requests x K drafts; per round (drafts verified, accepted) per step."""
    out = []
    for _ in range(rounds):
        admitted_sum = accepted_sum = 0
        for _ in range(est.settings.refit_interval):
            features = torch.randn(8, K, generator=gen) + 2.0
            predictions = est.predict(features)
            admitted = est.admit(predictions, torch.full((8,), K), MIN_SURVIVAL)
            success = torch.rand(8, K, generator=gen) < true_rate(features)
            inside = torch.arange(K)[None, :] < admitted[:, None]
            accepted = (success & inside).long().cumprod(dim=1).sum(dim=1)
            est.observe(features, predictions, accepted, admitted)
            est.end_step()
            admitted_sum += int(admitted.sum())
            accepted_sum += int(accepted.sum())
        steps = est.settings.refit_interval
        out.append((admitted_sum / steps, accepted_sum / steps))
    return out


def one_confident_miss(est: AcceptanceEstimator) -> float:
    """A data-poor round: one graded draft, predicted near-certain (feature 40), rejected. Returns the
    intercept change at position 0."""
    before = float(est.intercepts[0])
    features = torch.tensor([[40.0, 0.0, 0.0, 0.0]])
    est.observe(features, est.predict(features), torch.tensor([0]), torch.tensor([1]))
    for _ in range(est.settings.refit_interval):
        est.end_step()
    return float(est.intercepts[0]) - before


def test_the_newton_step_solves_the_regularised_irls_system() -> None:
    """With no damping, a refit step is exactly (X^T W X + l2 I)^-1 X^T (y - p) over the graded drafts."""
    gen = torch.Generator().manual_seed(0)
    est = AcceptanceEstimator(K, EstimatorSettings(damping=0.0))
    features = torch.randn(64, K, generator=gen) * 3
    predictions = torch.rand(64, K, generator=gen) * 0.9 + 0.05
    admitted = torch.randint(1, K + 1, (64,), generator=gen)
    accepted = torch.minimum(torch.randint(0, K + 1, (64,), generator=gen), admitted)
    est.observe(features, predictions, accepted, admitted)
    rows, targets = [], []
    weights = []
    for i in range(64):
        for k in range(K):
            if k <= accepted[i] and k < admitted[i]:
                x = [float(features[i, k])] + [1.0 if j == k else 0.0 for j in range(K)]
                p = float(predictions[i, k])
                rows.append(x)
                weights.append(p * (1 - p))
                targets.append((1.0 if k < accepted[i] else 0.0) - p)
    x = torch.tensor(rows, dtype=torch.float64)
    w = torch.tensor(weights, dtype=torch.float64)
    r = torch.tensor(targets, dtype=torch.float64)
    exact = torch.linalg.solve(x.T @ (w[:, None] * x) + 1e-3 * torch.eye(K + 1, dtype=torch.float64), x.T @ r)
    step_w, step_b = est.newton_step()
    assert abs(step_w - float(exact[0])) < 1e-9
    assert torch.allclose(step_b, exact[1:], atol=1e-9)


def test_draft_feature_is_the_log_odds_of_the_top_token() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=gen) * 3
    q = torch.softmax(logits.double() / 0.7, dim=-1).max(dim=-1).values
    expected = torch.log(q / (1 - q))
    assert torch.allclose(draft_feature(logits, torch.full((5,), 0.7)).double(), expected, atol=1e-4)
    spike = torch.full((1, 300), -1e4)
    spike[0, 3] = 0.0
    assert float(draft_feature(spike)[0]) == 40.0  # clamped, as stock


def test_stock_collapses_after_one_confident_miss_and_never_recovers() -> None:
    est = AcceptanceEstimator(K, STOCK)
    assert serve(est, 1, high, torch.Generator().manual_seed(2))[0][0] > 0  # it speculated before
    est = AcceptanceEstimator(K, STOCK)
    drop = one_confident_miss(est)
    assert -25 < drop < -15, drop  # the residual (about -1) divided by about the ridge, damped by 1/51
    assert float(est.predict(torch.tensor([[2.0, 2.0, 2.0, 2.0]]))[0, 0]) < 1e-6
    rounds = serve(est, 10, high, torch.Generator().manual_seed(3))
    assert all(admitted == 0 for admitted, _ in rounds), rounds  # no draft verified for 1,000 steps
    assert float(est.intercepts[0]) == INIT_BIAS + drop  # nothing graded, nothing learnt: for good


def test_the_trust_region_bounds_the_miss_and_the_estimator_recovers() -> None:
    est = AcceptanceEstimator(K, ROBUST)
    drop = one_confident_miss(est)
    assert drop == -ROBUST.max_step  # same evidence, bounded step
    rounds = serve(est, 10, high, torch.Generator().manual_seed(3))
    assert rounds[0][0] > 0 and rounds[-1][0] > 3.0 * 8 * 0.8, rounds  # verifies most drafts again
    features = torch.randn(4000, K, generator=torch.Generator().manual_seed(4)) + 2.0
    error = (est.predict(features) - high(features).double()).abs().mean()
    assert float(error) < 0.05, float(error)  # and predicts the real acceptance


def test_exploration_recovers_after_a_stretch_the_drafter_cannot_follow() -> None:
    """Good, then 15 rounds the drafter cannot follow (every estimator learns to admit nothing), then
    good again: only exploration notices."""
    results = {}
    for name, settings in (("stock", STOCK), ("bounded", NO_EXPLORATION), ("robust", ROBUST)):
        est = AcceptanceEstimator(K, settings)
        gen = torch.Generator().manual_seed(5)
        serve(est, 5, high, gen)
        stretch = serve(est, 15, low, gen)
        assert stretch[-1][0] < 1.0, (name, stretch)  # by the end it verified (almost) nothing
        results[name] = (serve(est, 10, high, gen), est.explorations)
    for name in ("stock", "bounded"):
        rounds, explorations = results[name]
        assert explorations == 0 and all(admitted == 0 for admitted, _ in rounds), (name, rounds)
    rounds, explorations = results["robust"]
    assert explorations > 0
    assert rounds[-1][0] > 3.0 * 8 * 0.8 and rounds[-1][1] > 2.5 * 8 * 0.8, rounds  # speculating fully again
