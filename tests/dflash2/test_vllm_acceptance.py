"""dflash2.vllm_acceptance (K20 inside vLLM): stock's own estimator class and kernels collapse after one
confident miss; the subclass dflash2 installs bounds the refit and explores after idle steps.

vLLM's `OnlineAcceptanceEstimator` runs its Triton kernels here under Triton's interpreter on CPU
tensors, in a subprocess that turns vLLM's Triton on (`tests.vllm_triton`) and installs dflash2's
post-import hook before the module is imported. Model Runner V2, which builds the estimator inside a
serving engine, runs on GPUs only; this checks the class the engine would build.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from dflash2 import vllm_acceptance
from dflash2.acceptance import ROBUST
from tests.vllm_triton import call_in_subprocess

K = 4
REQS = 8


def scenario() -> dict[str, Any]:
    """(in the subprocess) Stock's and the robust estimator through the same verdicts."""
    import torch

    from dflash2 import vllm_acceptance as va

    va.install()
    module = __import__(va.MODULE, fromlist=[va.CLASS])
    robust_cls = getattr(module, va.CLASS)
    stock_cls = robust_cls.__mro__[1]
    out: dict[str, Any] = {"installed": robust_cls.__name__, "stock_class": stock_cls.__name__}
    vocab = 300
    temperature = torch.ones(REQS)
    one = torch.zeros(1, dtype=torch.int32)

    def conf_after_predict(est: Any, logits: torch.Tensor) -> list[float]:
        confidence = torch.zeros(REQS, K)
        idx = torch.arange(logits.shape[0], dtype=torch.int32)
        est.predict(logits, idx, torch.tensor(0), confidence, temperature)
        return [float(c) for c in confidence[: logits.shape[0], 0]]

    def idle(est: Any, steps: int) -> None:  # verdicts that grade nothing (no draft verified)
        for _ in range(steps):
            est.step(one, torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))

    typical = torch.zeros(2, vocab)
    typical[:, 0] = 8.0  # a draft distribution with q(top) = 0.91: feature 2.3
    for name, cls in (("stock", stock_cls), ("robust", robust_cls)):
        est = cls(REQS, K, torch.device("cpu"))
        before = float(est.intercepts[0])
        spike = torch.full((1, vocab), -1e4)
        spike[0, 3] = 0.0  # feature clamped to 40: predicted near-certain
        conf_after_predict(est, spike)
        # the one graded draft of the round: request 0's first draft, rejected
        est.step(one, torch.ones(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
        idle(est, est.REFIT_INTERVAL - 1)  # the refit comes at the round's end
        result = {"drop": float(est.intercepts[0]) - before, "slope": float(est.slope[0])}
        if name == "stock":
            result["typical"] = conf_after_predict(est, typical)
        else:
            # REFIT_INTERVAL - 1 idle steps so far: exploring since the 16th
            result["idle_steps"] = int(est.idle_steps)
            result["explored"] = conf_after_predict(est, typical)
            # a step that grades a draft (accepted: 2 tokens sampled) ends the exploration
            est.step(one, torch.full((1,), 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
            result["typical"] = conf_after_predict(est, typical)
            idle(est, ROBUST.explore_after_idle_steps - 1)  # type: ignore[operator]
            result["one_step_short"] = conf_after_predict(est, typical)
            idle(est, 1)
            result["again"] = conf_after_predict(est, typical)
        out[name] = result
    return out


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(vllm_acceptance.SETTING_ENV, None)
    result: dict[str, Any] = call_in_subprocess("tests.dflash2.test_vllm_acceptance", "scenario", env)
    return result


def test_install_replaces_stocks_class_when_vllm_imports_it(report: dict[str, Any]) -> None:
    assert report["installed"] == "RobustAcceptanceEstimator"
    assert report["stock_class"] == vllm_acceptance.CLASS


def test_stocks_estimator_collapses_after_one_confident_miss(report: dict[str, Any]) -> None:
    stock = report["stock"]
    assert -25 < stock["drop"] < -15, stock  # about -1 / the ridge, damped by 1 / 51
    assert max(stock["typical"]) < 1e-6, stock  # no draft will be verified again


def test_the_robust_estimator_bounds_the_refit(report: dict[str, Any]) -> None:
    robust = report["robust"]
    assert abs(robust["drop"] + ROBUST.max_step) < 1e-6, robust  # type: ignore[operator]
    low, high = ROBUST.slope_bounds  # type: ignore[misc]
    assert low <= robust["slope"] <= high
    assert min(robust["typical"]) > 0.1, robust  # drafts stay worth verifying


def test_the_robust_estimator_explores_after_idle_steps(report: dict[str, Any]) -> None:
    robust = report["robust"]
    assert robust["idle_steps"] >= ROBUST.explore_after_idle_steps  # type: ignore[operator]
    assert robust["explored"] == [1.0, 1.0]  # every request's first draft is verified
    assert max(robust["typical"]) < 0.5  # after a graded draft: the model's own prediction again
    assert robust["one_step_short"] == robust["typical"]
    assert robust["again"] == [1.0, 1.0]


def test_a_changed_stock_class_is_refused_naming_what_changed() -> None:
    class Changed:
        REFIT_INTERVAL = 100

        def __init__(self, max_num_reqs: int, num_speculative_steps: int, device: Any) -> None: ...

        def step(self, idx_mapping: Any, num_sampled: Any) -> None: ...

        def predict(
            self, logits: Any, idx_mapping: Any, draft_step: Any, confidence_probs: Any, temperature: Any
        ) -> None: ...

    with pytest.raises(vllm_acceptance.StockChanged, match=r"OnlineAcceptanceEstimator.step is .*num_rejected"):
        vllm_acceptance.robust_estimator_class(Changed)


def test_the_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_acceptance.SETTING_ENV, "stock")
    assert vllm_acceptance.install() is None
    monkeypatch.setenv(vllm_acceptance.SETTING_ENV, "fast")
    with pytest.raises(ValueError, match="DFLASH2_ACCEPTANCE_ESTIMATOR='fast': use one of robust, stock"):
        vllm_acceptance.install()
