"""What the engine tests share about how their stock vLLM engines run.

`IN_PROCESS`: environment for an engine script (`vllm.LLM` in a subprocess of the test) whose
engine core runs in that script's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); at
tensor-parallel size 1 the worker runs there too (stock's CPU platform then keeps vLLM's
uniprocess executor), at larger sizes vLLM still spawns one worker process per rank. Every process
vLLM spawns imports torch and vLLM again, 10-20 s each on a 2-core machine, and the tokens,
logprobs and parameters these tests compare do not depend on which process computes them. vLLM's
default three-process layout (API server, engine core, worker) runs in the server tests
(tests/soak/test_soak.py and tests/tool_parsers/test_tool_parsers_server.py check that every plugin
registers in each of the three).

`engine_cores`: every stock vLLM engine a test starts runs while the test holds engine cores, one
per rank. `scripts/test.sh` runs the suite in two pytest-xdist workers, so two single-rank engines
can run at once, each with its worker's OpenMP thread bound to a core of its own; a two-rank engine
holds both cores. The cores are taken through lock files in /tmp, so separate pytest runs on one
machine share them too; a benchmark holds all of them (`python tests/engines.py CMD`). Two engines
bound to the same core (vLLM's automatic binding picks core 0 for each), or OpenMP threads
spin-waiting on a busy core, make a run several times slower.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# The machine's first two cores: CI has two, and a two-rank engine needs two.
CORES = sorted(os.sched_getaffinity(0))[:2]
LOCKS = Path("/tmp")


def _lock_file(core: int) -> Path:
    return LOCKS / f"qwen38-vllm-core{core}.lock"


@contextlib.contextmanager
def hold_cores(count: int = 1) -> Iterator[list[int]]:
    """Hold ``count`` engine cores (1, or all of `CORES`), blocking until they are free; yields
    their ids. One core: this xdist worker's own if free, else any free one, else wait for its own."""
    if count not in (1, len(CORES)):
        raise ValueError(f"count: an engine holds 1 or {len(CORES)} cores on this machine, got {count}")
    with contextlib.ExitStack() as stack:
        files = {core: stack.enter_context(open(_lock_file(core), "w")) for core in CORES}
        if count == len(CORES):
            for core in CORES:  # in ascending order: two holders of every core cannot deadlock
                fcntl.flock(files[core], fcntl.LOCK_EX)
            yield list(CORES)
            return
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        preferred = CORES[int(worker) % len(CORES)] if worker.isdigit() else CORES[0]
        for core in [preferred, *(c for c in CORES if c != preferred)]:
            try:
                fcntl.flock(files[core], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            yield [core]
            return
        fcntl.flock(files[preferred], fcntl.LOCK_EX)
        yield [preferred]


@contextlib.contextmanager
def engine_cores(count: int = 1) -> Iterator[str]:
    """`hold_cores` for an engine (1 core, or 2 for a two-rank engine); yields the
    ``VLLM_CPU_OMP_THREADS_BIND`` value for them ("1", or "0|1"), which is also set in
    ``os.environ`` for the duration, so a server or engine subprocess started inside binds to them."""
    asked = time.monotonic()
    with hold_cores(count) as held:
        got = time.monotonic()
        bind = "|".join(str(core) for core in held)
        previous = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        try:
            yield bind
        finally:
            if previous is None:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            else:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = previous
            _log_engine_time(count, got - asked, time.monotonic() - got)


def _log_engine_time(cores: int, waited: float, held: float) -> None:
    """With ``QWEN38_ENGINE_TIMES=FILE``, one line per engine: the test (pytest's id and phase), the
    cores held, seconds waited for them and seconds held. pytest's ``--durations`` counts the wait
    for another worker's engine as the waiting test's own time; this separates the two, which is
    what deciding where the suite's time goes needs."""
    target = os.environ.get("QWEN38_ENGINE_TIMES")
    if not target:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "-").replace("\t", " ")
    with open(target, "a") as f:
        f.write(f"{held:8.1f} {waited:7.1f} {cores} {test}\n")


def run_engine_script(
    cmd: Sequence[str], env: Mapping[str, str], cores: int = 1, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """Run an engine script (``cmd``) holding ``cores`` engine cores, its OpenMP threads bound to
    them (``env``'s own ``VLLM_CPU_OMP_THREADS_BIND`` is replaced); output captured, never raises
    on a failed run."""
    with engine_cores(cores) as bind:
        return subprocess.run(
            list(cmd), env={**env, "VLLM_CPU_OMP_THREADS_BIND": bind}, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip


if __name__ == "__main__":
    # `python tests/engines.py CMD ...`: run CMD holding every engine core (a benchmark measuring
    # alone: no engine of the tests runs meanwhile); exits with CMD's status.
    import sys

    if len(sys.argv) < 2:
        raise SystemExit("usage: python tests/engines.py CMD [ARG ...]  (runs CMD holding every engine core)")
    with hold_cores(len(CORES)):
        raise SystemExit(subprocess.call(sys.argv[1:]))
