"""``read_ahead``: a weight stream run on a worker thread ahead of its consumer.

The CSF loader wraps its stream in it when the Triton kernel decodes (``device_path_check.py`` runs
the decoded streams through it against the host path; ``test_qwen4exp_csf.py`` serves an engine
loaded through it). These tests hold it to its guarantees on plain streams: order, bounds, errors
where they happened, and a consumer that stops early stopping the worker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from csf_loader.read_ahead import ENV, ReadAheadConfigError, read_ahead, read_ahead_enabled
from csf_loader.stream import CsfLoadError


class Counted:
    """A stream of ``n`` tensors of ``size`` bytes that counts what was taken from it and whether it was closed."""

    def __init__(self, n: int, size: int = 4, fail_at: int | None = None) -> None:
        self.n, self.size, self.fail_at = n, size, fail_at
        self.taken = 0
        self.closed = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise CsfLoadError(f"model-00001-of-00001.safetensors: layer.{i}.weight_scale: row 0 has base 250")
                self.taken += 1
                yield f"layer.{i}.weight", torch.full((self.size,), i % 256, dtype=torch.uint8)
        finally:
            self.closed = True


def wait_for(condition: object, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.005)
    return False


def no_worker() -> bool:
    return not any(t.name == "csf-read-ahead" for t in threading.enumerate())


def test_items_come_in_order_and_the_stream_is_closed() -> None:
    source = Counted(200)
    got = list(read_ahead(source, max_items=3))
    assert [name for name, _ in got] == [f"layer.{i}.weight" for i in range(200)]
    assert all(int(t[0]) == i % 256 for i, (_, t) in enumerate(got))
    assert source.closed and no_worker()


def test_the_worker_runs_ahead_by_at_most_the_bound() -> None:
    source = Counted(50)
    stream = read_ahead(source, max_items=4)
    next(stream)
    # the worker fills the window while the consumer holds still (4 items waiting, a fifth in its hand)
    # and stops there
    assert wait_for(lambda: source.taken == 1 + 4 + 1)
    time.sleep(0.1)
    assert source.taken == 1 + 4 + 1
    next(stream)
    assert wait_for(lambda: source.taken == 2 + 4 + 1)
    stream.close()
    assert source.closed and no_worker()


def test_the_byte_bound_holds_and_a_larger_item_still_passes() -> None:
    source = Counted(20, size=100)
    stream = read_ahead(source, max_items=64, max_bytes=250)
    next(stream)
    # two 100-byte items fit in 250 bytes; a third waits in the worker's hand
    assert wait_for(lambda: source.taken == 1 + 2 + 1)
    time.sleep(0.1)
    assert source.taken == 1 + 2 + 1
    stream.close()
    big = Counted(3, size=1000)  # each item alone is over the bound: one at a time, never stuck
    assert len(list(read_ahead(big, max_bytes=250))) == 3


def test_an_error_reaches_the_consumer_after_the_items_before_it() -> None:
    source = Counted(10, fail_at=6)
    seen = []
    message = r"model-00001-of-00001.safetensors: layer.6.weight_scale: row 0 has base 250"
    with pytest.raises(CsfLoadError, match=message):
        for name, _ in read_ahead(source, max_items=2):
            seen.append(name)
    assert seen == [f"layer.{i}.weight" for i in range(6)]
    assert source.closed and wait_for(no_worker)


def test_a_consumer_that_stops_stops_the_worker() -> None:
    source = Counted(10_000)
    stream = read_ahead(source, max_items=8)
    for _ in range(3):
        next(stream)
    stream.close()  # what a failing weight loader does to the generator it was iterating
    assert source.closed and no_worker()
    assert source.taken <= 3 + 8 + 1  # taken, waiting, in the worker's hand


def test_bad_bounds_and_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="max_items 0 must be >= 1"):
        next(read_ahead(Counted(1), max_items=0))
    monkeypatch.delenv(ENV, raising=False)
    assert read_ahead_enabled() is False  # in line by default: faster on the H100 (2026-12-05)
    monkeypatch.setenv(ENV, "1")
    assert read_ahead_enabled() is True
    monkeypatch.setenv(ENV, "0")
    assert read_ahead_enabled() is False
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ReadAheadConfigError, match=r"CSF_LOADER_READ_AHEAD='yes': use 0 .* or 1"):
        read_ahead_enabled()


def test_the_loader_refuses_a_bad_setting_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config.load import LoadConfig

    from csf_loader.vllm_loader import CsfModelLoader

    monkeypatch.setenv(ENV, "2")
    with pytest.raises(CsfLoadError, match=r"csf_loader: CSF_LOADER_READ_AHEAD='2'"):
        CsfModelLoader(LoadConfig(load_format="csf"))
    monkeypatch.setenv(ENV, "1")
    assert CsfModelLoader(LoadConfig(load_format="csf")).read_ahead is True
    monkeypatch.delenv(ENV)
    loader = CsfModelLoader(LoadConfig(load_format="csf"))
    assert loader.read_ahead is False and loader.decoder_for(nn.Linear(2, 2)).device == torch.device("cpu")


def test_a_stream_that_cannot_start_fails_the_consumer_instead_of_hanging_it() -> None:
    class Broken:
        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            raise CsfLoadError("model.safetensors: unreadable header")

    with pytest.raises(CsfLoadError, match=r"model\.safetensors: unreadable header"):
        next(read_ahead(Broken()))
    assert wait_for(no_worker)
