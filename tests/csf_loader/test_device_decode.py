"""Decode where the weights go: the dispatcher's choice, and the device path against the host path.

The device path (the Triton kernel on the device the parameters live on) runs here on CPU tensors
under ``TRITON_INTERPRET=1``, the CPU standing in for the GPU: ``device_path_check.py`` streams the
same checkpoints through both paths and compares every tensor and every startup error. On a GPU
the same script runs with the GPU (``test_csf_cuda.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from csf_loader.device_decode import ENV, DecodeConfigError, PlaneDecoder, kernel_for

HERE = Path(__file__).parent


def test_kernel_follows_the_device_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert kernel_for(cpu) == "torch" and kernel_for(cuda) == "triton"
    assert kernel_for(cpu, "triton") == "triton" and kernel_for(cuda, "torch") == "torch"
    monkeypatch.setenv(ENV, "triton")
    assert kernel_for(cpu) == "triton"
    monkeypatch.setenv(ENV, "torch")
    assert kernel_for(cuda) == "torch"
    monkeypatch.setenv(ENV, "gpu")
    with pytest.raises(DecodeConfigError, match=r"CSF_LOADER_DECODE='gpu': use auto .* torch or triton"):
        kernel_for(cpu)
    monkeypatch.setenv(ENV, "auto")
    assert PlaneDecoder(cpu).describe() == "on cpu with the torch codec"
    assert PlaneDecoder(cuda).describe() == "on cuda:0 with the Triton kernel"


def test_loader_decodes_on_the_device_of_the_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config.load import LoadConfig

    from csf_loader.stream import CsfLoadError
    from csf_loader.vllm_loader import CsfModelLoader

    monkeypatch.delenv(ENV, raising=False)
    loader = CsfModelLoader(LoadConfig(load_format="csf"))
    model = nn.Linear(4, 4)
    assert loader.decoder_for(model).device == torch.device("cpu")
    assert loader.decoder_for(model.to("meta")).device == torch.device("cpu")  # nothing placed yet
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(CsfLoadError, match=r"csf_loader: CSF_LOADER_DECODE='fast'"):
        loader.decoder_for(nn.Linear(4, 4))


def test_device_path_equals_host_path_under_interpreter() -> None:
    # TRITON_INTERPRET is read when the kernels are decorated: a fresh process. The script imports
    # tests.csf_loader.toy_checkpoints: the repository root goes on its path (pytest puts it on
    # this process's sys.path only).
    pythonpath = os.pathsep.join(filter(None, [str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath)
    cmd = [sys.executable, str(HERE / "device_path_check.py"), "cpu"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "device=cpu checks=" in result.stdout and "failures=0" in result.stdout, result.stdout


def test_a_streamed_plane_is_checked_on_the_host_before_it_is_copied() -> None:
    """A plane read from a file is on the host: its values are checked there, before the copy to the
    device (a check on a GPU reads back and waits for every copy queued before it). The "meta" device
    stands in for the GPU: a check that ran there could not read values and would fail otherwise."""
    from csf_loader.codec import NVFP4_CSF, SLAB_ROWS, CsfFormatError, CsfPlane, encode

    rows, cols = 32, 64
    scales = torch.randint(100, 110, (rows, cols), dtype=torch.uint8)
    plane = encode(scales, NVFP4_CSF)
    fixed = plane.fixed.clone()
    fixed.reshape(rows // SLAB_ROWS, -1)[1, 3] = 255  # row 16 + 3's base above the limit
    decoder = PlaneDecoder(torch.device("meta"), "torch")
    refused = r"w\.weight_scale\.nvfp4_csf_fixed: row 19 has base 255 above .* limit 240"
    with pytest.raises(CsfFormatError, match=refused):
        decoder.decode(CsfPlane(fixed, plane.exceptions), NVFP4_CSF, rows, cols, "w.weight_scale")
