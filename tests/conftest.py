"""Shared fixtures: tiny checkpoints (built once per content) and stock vLLM servers."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest

from qwen38_plugin.tiny import checkpoints as tiny_checkpoints
from tools.vllm_server import VllmServer

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "tests"


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Two workers share two cores with the engines they start: one torch thread each, or
        # OpenMP threads spin-wait on a busy core and run several times slower.
        import torch

        torch.set_num_threads(1)


# Files whose tests start stock vLLM engines or servers: a minute to five each on two cores.
ENGINE_FILE_WORDS = ("engine", "server", "soak")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Engine and server files first, then the rest, each by test count (most first), a file's
    tests in their own order. With ``--dist loadfile --no-loadscope-reorder`` (scripts/test.sh)
    xdist hands the workers files in this order: the minutes-long files start early and the
    seconds-long ones fill in at the end, where xdist's own order (test count alone) left one
    worker running engine files after the other finished (2026-12-03: the per-file times of a
    junit report, 3,301 s of tests, scheduled in xdist's order come to about 1,500 and 1,800 s
    for the two workers, in this order to about 1,650 each)."""
    counts = Counter(item.nodeid.split("::")[0] for item in items)

    def weight(item: pytest.Item) -> tuple[bool, int]:
        path = item.nodeid.split("::")[0]
        light = not any(word in path.rsplit("/", 1)[-1] for word in ENGINE_FILE_WORDS)
        return light, -counts[path]

    items.sort(key=weight)  # stable: a file's tests keep their order


def _builder_digest() -> str:
    # A cached checkpoint is reused only while the builder's code is unchanged.
    tiny_dir = Path(tiny_checkpoints.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(tiny_dir.glob("*")):
        if path.is_file() and path.suffix in {".py", ".jinja"}:
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def building(out: Path) -> Iterator[None]:
    """Hold the build lock of the cached directory ``out``: the suite runs in two pytest-xdist
    workers that share `.cache/tests`, so a builder checks for ``out`` and builds it inside."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_cached_checkpoint(
    model_type: str, seed: int = 0, overrides: Mapping[str, Any] | None = None, dtype: str = "bfloat16"
) -> Path:
    key = json.dumps([_builder_digest(), model_type, seed, dict(overrides or {}), dtype], sort_keys=True)
    out = CACHE / "checkpoints" / f"{model_type}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    with building(out):
        if not out.exists():
            tiny_checkpoints.build_tiny_checkpoint(out, model_type, seed=seed, overrides=overrides, dtype=dtype)
    return out


class CheckpointFactory(Protocol):
    def __call__(
        self,
        model_type: str,
        seed: int = 0,
        overrides: Mapping[str, Any] | None = None,
        dtype: str = "bfloat16",
    ) -> Path: ...


@pytest.fixture(scope="session")
def tiny_checkpoint() -> CheckpointFactory:
    """`tiny_checkpoint(model_type, seed=0, overrides=None)`: path of a built tiny checkpoint."""
    return build_cached_checkpoint


class ServerFactory(Protocol):
    def __call__(
        self, model: Path | str, args: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> VllmServer: ...


# Servers started by `start_server` in the running module: a failing test's report carries the
# end of each one's log (CI shows a test's report, not the log files under .cache/tests/logs). A
# server whose engine died may still be shutting down when the test stops it, so every server of
# the module is reported, with its state.
_SERVERS: list[VllmServer] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed:
        for server in _SERVERS:
            code = server.process.poll() if server.process is not None else None
            if code is None:
                state = "running"
            elif server.stopped:
                state = f"stopped by the test (exit code {code})"
            else:
                state = f"exited by itself with code {code}"
            report.sections.append((f"vLLM server log, {state} ({server.log_path})", server.log()[-8000:]))
    return report


@pytest.fixture(scope="module")
def start_server(request: pytest.FixtureRequest) -> Iterator[ServerFactory]:
    """Start stock vLLM servers for one test module; all are stopped when the module ends.

    Servers take about a minute to start on 2 cores: start one per module, not per test.
    """

    def start(model: Path | str, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> VllmServer:
        name = f"{request.module.__name__.rsplit('.', 1)[-1]}-{len(_SERVERS)}"
        server = VllmServer(model, args, env=env, log_path=CACHE / "logs" / f"{name}.log")
        _SERVERS.append(server)
        return server.start()

    yield start
    for server in _SERVERS:
        server.stop()
    _SERVERS.clear()
