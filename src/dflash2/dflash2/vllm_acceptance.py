"""K20 inside vLLM: stock's online acceptance estimator with a trust region, bounds and exploration.

Stock vLLM 0.32's Model Runner V2 (GPU) builds `OnlineAcceptanceEstimator`
(`v1/worker/gpu/spec_decode/acceptance_estimator.py`) for adaptive verification and has no registry
for it, so this is dflash2's one monkeypatch of it: `RobustAcceptanceEstimator` subclasses stock's
class, keeps its kernels and its math, and adds `dflash2.acceptance.ROBUST`'s guards:

- after each of stock's refits, no coefficient moved by more than ``max_step`` and all stay within
  their bounds (device ops on the coefficients stock just wrote, no host sync);
- after ``explore_after_idle_steps`` steps that verified no draft, the next draft step predicts
  acceptance 1 for every request's first draft, so adaptive verification verifies one draft per
  request; the first graded draft resets the count. The count lives on the device and is updated
  from the verdicts every rank sees, so every rank makes the same choice; only the number of
  verified drafts changes, rejection sampling keeps the output exact.

`install()` replaces the class in stock's module when that module is imported (a post-import
hook: importing it costs seconds, and only the GPU worker of a speculative engine does), so the
speculator, which imports the name from there, builds ours. `check_stock` runs first and raises
`StockChanged` on a vLLM whose estimator lacks what the subclass relies on.
`DFLASH2_ACCEPTANCE_ESTIMATOR=stock` keeps stock's estimator.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from dflash2.acceptance import ROBUST

logger = logging.getLogger("vllm.plugins.dflash2")

MODULE = "vllm.v1.worker.gpu.spec_decode.acceptance_estimator"
CLASS = "OnlineAcceptanceEstimator"
SETTING_ENV = "DFLASH2_ACCEPTANCE_ESTIMATOR"
SETTINGS = ("robust", "stock")
STOCK_SIGNATURES = {
    "__init__": ("self", "max_num_reqs", "num_speculative_steps", "device"),
    "step": ("self", "idx_mapping", "num_sampled", "num_rejected"),
    "predict": ("self", "logits", "idx_mapping", "draft_step", "confidence_probs", "temperature"),
}
STOCK_ATTRIBUTES = ("REFIT_INTERVAL",)
STOCK_STATE = ("_steps_since_refit", "slope", "intercepts")  # set by stock's __init__


class StockChanged(RuntimeError):
    """The installed vLLM's acceptance estimator is not the one this module extends."""


def check_stock(stock: Any) -> None:
    """Raise `StockChanged` unless `stock` has the methods, signatures and state the subclass uses."""
    for name, parameters in STOCK_SIGNATURES.items():
        method = getattr(stock, name, None)
        found = tuple(inspect.signature(method).parameters) if callable(method) else None
        if found != parameters:
            raise StockChanged(
                f"dflash2: vLLM's {MODULE}.{CLASS}.{name} is {found}, expected {parameters}; "
                f"this vLLM is not 0.32 / 0.33: set {SETTING_ENV}=stock or update dflash2"
            )
    source = inspect.getsource(stock.__init__) + inspect.getsource(stock.step)
    missing = [a for a in STOCK_ATTRIBUTES if not hasattr(stock, a)] + [s for s in STOCK_STATE if s not in source]
    if missing:
        raise StockChanged(f"dflash2: vLLM's {MODULE}.{CLASS} no longer has {missing}; set {SETTING_ENV}=stock")


def _bound(value: torch.Tensor, before: torch.Tensor, max_step: float, low: float, high: float) -> None:
    step = (value - before).clamp(-max_step, max_step)
    value.copy_((before + step).clamp(low, high))


def robust_estimator_class(stock: Any) -> Any:
    """Stock's estimator class with `dflash2.acceptance.ROBUST`'s trust region, bounds and exploration."""
    check_stock(stock)
    settings = ROBUST
    assert settings.max_step is not None and settings.slope_bounds and settings.intercept_bounds
    assert settings.explore_after_idle_steps is not None
    max_step, slope_bounds, intercept_bounds = settings.max_step, settings.slope_bounds, settings.intercept_bounds
    explore_after = settings.explore_after_idle_steps

    class RobustAcceptanceEstimator(stock):
        """Stock's estimator, its refits bounded, exploring after idle steps (dflash2, K20)."""

        def __init__(self, max_num_reqs: int, num_speculative_steps: int, device: torch.device) -> None:
            super().__init__(max_num_reqs, num_speculative_steps, device)
            # steps in a row whose verdicts graded no draft (shared by every rank's identical verdicts)
            self.idle_steps = torch.zeros((), dtype=torch.int64, device=device)
            # (installing the class says nothing of its use: vLLM imports stock's module in other runners too)
            logger.info(
                "dflash2: adaptive verification's acceptance estimator built (%d requests, %d drafts): refits moved "
                "at most %s, exploring after %d idle steps",
                max_num_reqs, num_speculative_steps, max_step, explore_after,
            )  # fmt: skip

        def step(self, idx_mapping: torch.Tensor, num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> None:
            refits = self._steps_since_refit + 1 >= self.REFIT_INTERVAL  # stock's own host-side counter
            if refits:
                slope, intercepts = self.slope.clone(), self.intercepts.clone()
            super().step(idx_mapping, num_sampled, num_rejected)
            if refits:
                _bound(self.slope, slope, max_step, *slope_bounds)
                _bound(self.intercepts, intercepts, max_step, *intercept_bounds)
            graded = (num_sampled - 1).clamp(min=0).sum() + num_rejected.sum()
            self.idle_steps.copy_(torch.where(graded > 0, torch.zeros_like(self.idle_steps), self.idle_steps + 1))

        def predict(
            self,
            logits: torch.Tensor,
            idx_mapping: torch.Tensor,
            draft_step: torch.Tensor,
            confidence_probs: torch.Tensor,
            temperature: torch.Tensor,
        ) -> None:
            super().predict(logits, idx_mapping, draft_step, confidence_probs, temperature)
            # rows of confidence_probs: one per token, or per request when each token has its own step
            rows = logits.shape[0] // self.num_speculative_steps if draft_step.dim() > 0 else logits.shape[0]
            first = confidence_probs[:rows, 0]
            explore = self.idle_steps >= explore_after
            first.copy_(torch.where(explore, torch.ones_like(first), first))  # inside the draft graph: no sync

    return RobustAcceptanceEstimator


def setting() -> str:
    value = os.environ.get(SETTING_ENV, "robust") or "robust"
    if value not in SETTINGS:
        raise ValueError(f"{SETTING_ENV}={value!r}: use one of {', '.join(SETTINGS)}")
    return value


def patch(module: ModuleType) -> None:
    stock = getattr(module, CLASS)
    if getattr(stock, "_dflash2_robust", False):
        return
    robust = robust_estimator_class(stock)
    robust._dflash2_robust = True
    setattr(module, CLASS, robust)
    speculator = sys.modules.get("vllm.v1.worker.gpu.spec_decode.speculator")
    if speculator is not None and getattr(speculator, CLASS, None) is stock:
        setattr(speculator, CLASS, robust)  # imported before us: its name is rebound too
    logger.info("dflash2: adaptive verification uses the acceptance estimator with a trust region and exploration")


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `MODULE` through the other finders and patches it right after it executes."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                self._loader = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        patch(module)


def install() -> str | None:
    """Use the robust estimator wherever vLLM builds one; None when `DFLASH2_ACCEPTANCE_ESTIMATOR=stock`."""
    if setting() == "stock":
        return None
    if MODULE in sys.modules:
        patch(sys.modules[MODULE])
    elif not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
    return "robust acceptance estimator (K20)"
