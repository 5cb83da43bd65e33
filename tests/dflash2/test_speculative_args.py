"""dflash2.speculative_args: `dflash_concurrency_drafts` in stock vLLM's `--speculative-config`.

The config path runs in this process (stock `EngineArgs.create_engine_config`, no engine); one
test starts stock vLLM's real server module with a bad ladder and reads its refusal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from dflash2.ladder import LADDER_KEY, OPEN_END
from dflash2.speculative_args import StockChanged, check_stock, install, refuse_method_taken_from_the_path

K = 7


@pytest.fixture(scope="module")
def models(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from dflash2.tiny import build_tiny_drafter

    target = tiny_checkpoint("qwen3", dtype="float32")
    return target, build_tiny_drafter(tmp_path_factory.mktemp("drafter") / "dflash", target)


def engine_config(models: tuple[Path, Path], spec: dict[str, Any], **engine_args: Any) -> tuple[Any, Any]:
    from vllm.engine.arg_utils import EngineArgs

    import dflash2

    dflash2.register()
    target, drafter = models
    args = EngineArgs(
        model=str(target),
        max_model_len=512,
        speculative_config={"method": "dflash", "model": str(drafter), "num_speculative_tokens": K, **spec},
        **engine_args,
    )
    return args, args.create_engine_config()


def test_the_guard_accepts_this_vllm() -> None:
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    check_stock(EngineArgs, SpeculativeConfig)
    assert install() in ("installed", "already installed")
    assert install() == "already installed"  # idempotent: vLLM loads plugins more than once


def test_the_guard_fails_loudly_on_a_changed_vllm() -> None:
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    class NewArgs(EngineArgs):  # type: ignore[misc]
        def create_speculative_config(self, target_model_config: Any, parallel: Any, extra: Any) -> Any:
            return None

    with pytest.raises(StockChanged, match=r"takes \('self', 'target_model_config', 'parallel', 'extra'\)") as error:
        check_stock(NewArgs, SpeculativeConfig)
    assert "no longer builds SpeculativeConfig(**self.speculative_config)" in str(error.value)
    assert "write the ladder as num_speculative_tokens_per_batch_size" in str(error.value)

    class OldSpec:
        __dataclass_fields__: ClassVar[dict[str, Any]] = {"num_speculative_tokens": None}

    with pytest.raises(StockChanged, match="SpeculativeConfig has no field num_speculative_tokens_per_batch_size"):
        check_stock(EngineArgs, OldSpec)

    class NativeSpec:
        __dataclass_fields__: ClassVar[dict[str, Any]] = {
            "num_speculative_tokens_per_batch_size": None,
            "dflash_concurrency_drafts": None,
        }

    with pytest.raises(StockChanged, match="has its own field dflash_concurrency_drafts now; drop this patch"):
        check_stock(EngineArgs, NativeSpec)


@pytest.mark.parametrize("key", ["dflash_concurrency_drafts", "dflash-concurrency-drafts"])
def test_the_ladder_becomes_stocks_schedule_and_async_scheduling_goes_off(models: tuple[Path, Path], key: str) -> None:
    args, config = engine_config(models, {key: {"4": 3, "5": 4}})
    assert args.async_scheduling is False
    assert config.speculative_config.method == "dflash"
    assert config.speculative_config.num_speculative_tokens == K
    assert config.speculative_config.num_speculative_tokens_per_batch_size == [(1, 3, 7), (4, 4, 3), (5, OPEN_END, 4)]
    assert config.scheduler_config.async_scheduling is False
    # the user's key stays in EngineArgs: building the config again gives the same schedule
    again = args.create_engine_config()
    assert again.speculative_config.num_speculative_tokens_per_batch_size == [(1, 3, 7), (4, 4, 3), (5, OPEN_END, 4)]


def test_without_a_ladder_stock_is_unchanged(models: tuple[Path, Path]) -> None:
    args, config = engine_config(models, {})
    assert config.speculative_config.num_speculative_tokens_per_batch_size is None
    assert args.async_scheduling is None  # left to stock (which turns it off on CPU by itself)


@pytest.mark.parametrize(
    ("spec", "engine_args", "message"),
    [
        ({"dflash_concurrency_drafts": {"4": 9}}, {}, r"\['4'\]: width 9 is outside 1..num_speculative_tokens=7"),
        ({"dflash_concurrency_drafts": {"1": 3}}, {}, r"threshold 1 is below 2"),
        ({"dflash_concurrency_drafts": {"many": 3}}, {}, r"unknown key 'many'"),
        ({"dflash_concurrency_drafts": {"4": 3}}, {"async_scheduling": True}, r"drop --async-scheduling"),
        (
            {"dflash_concurrency_drafts": {"4": 3}, "num_speculative_tokens_per_batch_size": [[1, 8, 2]]},
            {},
            r"both set the verify width: keep one",
        ),
        ({"dflash_concurrency_drafts": {"4": 3}}, {"pipeline_parallel_size": 2}, r"use --pipeline-parallel-size 1"),
        (
            {},
            {"pipeline_parallel_size": 2},
            r"method='dflash' with pipeline_parallel_size=2.*--pipeline-parallel-size 1",
        ),
    ],
)
def test_startup_refuses_with_the_field_and_the_fix(
    models: tuple[Path, Path], spec: dict[str, Any], engine_args: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        engine_config(models, spec, **engine_args)


def test_mtp_on_a_path_stock_reads_as_dflash_is_refused_naming_the_path(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """Stock vLLM 0.32 turns `{"method": "mtp"}` into DFlash when the checkpoint's path contains
    "dflash" (and fails later on a `DFlash<arch>` architecture); startup says so instead."""
    from vllm.engine.arg_utils import EngineArgs

    import dflash2

    dflash2.register()
    target, _ = models
    (tmp_path / "my-dflash-runs").mkdir()
    linked = tmp_path / "my-dflash-runs" / "target"
    linked.symlink_to(target, target_is_directory=True)
    args = EngineArgs(model=str(linked), speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match=r"path contains 'dflash'.*serve it from a path without 'dflash'"):
        args.create_engine_config()
    # the same rule is silent on a clean path and for the methods that name their drafter's family
    refuse_method_taken_from_the_path({"method": "mtp"}, str(target))
    refuse_method_taken_from_the_path({"method": "dflash", "model": str(linked)}, str(target))


def test_the_server_refuses_a_bad_ladder_at_startup(models: tuple[Path, Path]) -> None:
    """Stock vLLM's server module exits before starting an engine, printing the field and the fix."""
    target, drafter = models
    ladder = {"4": 3, "5": 8}
    spec = json.dumps({"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7, LADDER_KEY: ladder})
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)]
    cmd += ["--max-model-len", "512", "--speculative-config", spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-4000:]
    assert (
        "speculative_config.dflash_concurrency_drafts['5']: width 8 is outside 1..num_speculative_tokens=7; "
        "use a width from 1 to 7" in log
    ), log[-4000:]
    assert "LadderError" in log
    assert "(EngineCore" not in log  # refused before any engine process started
