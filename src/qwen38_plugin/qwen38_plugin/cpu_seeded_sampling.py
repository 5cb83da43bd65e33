"""Seeded sampling with a chunked prompt on vLLM's CPU backend: stock 0.32 kills the engine.

vLLM's v1 model runner samples a token for every request in a step, also for a request
whose prompt is only partly prefilled, and discards that token. For a request with its own
`seed` it then rewinds the request's generator, so the discarded draw does not count
(`GPUModelRunner._bookkeeping_sync`: `gen.set_offset(gen.get_offset() - 4)`). That is right
for CUDA's Philox generators; a CPU generator has no offset, `get_offset()` raises
`RuntimeError: CPU Generator does not use offset`, the engine core dies and every request in
flight fails with HTTP 500. Any client that sends a `seed` (with temperature > 0) and a
prompt longer than `--max-num-batched-tokens` stops a CPU server (found by the soak test,
tests/soak).

There is no registry for the model runner, so `install()` wraps one method,
`CPUModelRunner.sample_tokens`, when vLLM imports `vllm.v1.worker.cpu_model_runner`: before
sampling, each request's generator becomes a `RewindableCpuGenerator` (same state; the
request's cached state points to it too) that remembers its state; the rewind after a
discarded sample restores that state. The discarded draw then never happened, as on CUDA: a
seeded request returns the same tokens however its prompt is split into chunks, whatever
else runs and whether it was preempted. Installed only on the CPU platform, and only while
stock's `_bookkeeping_sync` still rewinds with `set_offset(gen.get_offset() - 4)` (checked in
its source when the module is imported; otherwise the fix is skipped and says why).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger("vllm.plugins.qwen38_plugin")

TARGET_MODULE = "vllm.v1.worker.cpu_model_runner"
STOCK_REWIND = "gen.set_offset(gen.get_offset() - 4)"
_PATCHED = "_qwen38_rewinds_seeded_generators"
# The only offset step vLLM rewinds by: one sampling draw.
_DRAW = 4


class RewindableCpuGenerator(torch.Generator):
    """A CPU generator whose `set_offset(get_offset() - 4)` undoes this step's draw.

    A CPU generator (Mersenne Twister) has no offset; this one reports `get_offset() == 4`
    after `remember()` and takes `set_offset(0)` as "restore the state `remember()` saw".
    """

    _remembered: torch.Tensor | None = None

    @classmethod
    def copy_of(cls, generator: torch.Generator) -> RewindableCpuGenerator:
        copy = cls(device="cpu")
        copy.set_state(generator.get_state())
        return copy

    def remember(self) -> None:
        self._remembered = self.get_state()

    def get_offset(self) -> int:
        return _DRAW

    def set_offset(self, offset: int) -> RewindableCpuGenerator:
        if offset != 0 or self._remembered is None:
            raise RuntimeError(
                f"RewindableCpuGenerator only undoes the last sampling draw (set_offset(get_offset() - {_DRAW})); "
                f"got set_offset({offset}) {'without a remembered state' if self._remembered is None else ''}"
            )
        self.set_state(self._remembered)
        return self


def prepare_generators(runner: Any) -> None:
    """Give each seeded request of the runner's batch a generator that can undo this step's draw."""
    batch = runner.input_batch
    for index, generator in list(batch.generators.items()):
        if not isinstance(generator, RewindableCpuGenerator):
            replacement = RewindableCpuGenerator.copy_of(generator)
            batch.generators[index] = replacement
            # The request's cached state re-adds it to the batch later (after a step it was
            # not scheduled in, or a preemption): it must hold the same generator.
            state = runner.requests.get(batch.req_ids[index])
            if state is not None and state.generator is generator:
                state.generator = replacement
            generator = replacement
        generator.remember()


def patch_runner_class(runner_class: Any, stock_bookkeeping: Callable[..., Any]) -> bool:
    """Wrap `runner_class.sample_tokens`; False (and a log line) when stock no longer needs it."""
    if getattr(runner_class.sample_tokens, _PATCHED, False):
        return True
    try:
        source = inspect.getsource(stock_bookkeeping)
    except (OSError, TypeError):
        source = ""
    if STOCK_REWIND not in source:
        logger.info(
            "qwen38_plugin: vLLM's model runner no longer rewinds seeded generators with %r; "
            "the CPU seeded-sampling fix is not installed",
            STOCK_REWIND,
        )
        return False
    original = runner_class.sample_tokens

    @functools.wraps(original)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        prepare_generators(self)
        return original(self, *args, **kwargs)

    setattr(sample_tokens, _PATCHED, True)
    runner_class.sample_tokens = sample_tokens
    return True


def _patch_module(module: ModuleType) -> bool:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return patch_runner_class(module.CPUModelRunner, GPUModelRunner._bookkeeping_sync)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patch the CPU model runner right after vLLM imports its module (in the worker)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _patch_module(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> str:
    """Install the fix in this process (CPU platform only); says what it did."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not CPU"
    module = sys.modules.get(TARGET_MODULE)
    if module is not None:
        return "installed" if _patch_module(module) else "not needed"
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    return "installed on import"
