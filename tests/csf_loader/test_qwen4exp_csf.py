"""Qwen3.8 Flash-Next (Qwen4Exp) in NVFP4-CSF through stock vLLM on CPU: equal to its NVFP4 source.

The tiny Qwen4Exp (GDN, QSA, hyper-connections, PLE, MoE) is quantized to standard NVFP4 (ModelOpt)
where the CPU platform can run it (``tiny_qwen4exp.py`` says which layers and why the others stay
bf16), converted to NVFP4-CSF with every FP4 scale compressed (``--scope all``: on CPU the routed
experts, the published CSF target, stay bf16), and both are served by stock vLLM with the portable
model in fp16:

* the CSF checkpoint is loaded with ``--load-format csf`` through the device decode path (the
  Triton kernel, under ``TRITON_INTERPRET=1`` on CPU tensors: the CPU stands in for the GPU);
* every parameter equals the NVFP4 source's byte for byte, greedy tokens and top-5 logprobs are
  identical;
* the PLE tables keep the checkpoint's dtype (bf16) in an fp16 model (K15);
* a missing tensor and an unexpected one fail at startup naming it (R40): stock's loader, as an
  engine's worker runs it at startup, in one process for both (``load_only.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from csf_loader.convert import main as csf_convert
from tests.csf_loader.tiny_qwen4exp import quantize_qwen4exp_nvfp4
from tests.engines import IN_PROCESS, run_engine_script

HERE = Path(__file__).parent
PLANES = 26  # GDN in_proj_qkv, in_proj_z, out_proj (3 layers), QSA o_proj, shared experts (4), PLE (2 layers)


def run_engine(model: Path, load_format: str, out: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Stock vLLM (engine_run.py) at TP=1 in fp16; returns its tokens, logprobs, parameters and log."""
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        **IN_PROCESS,
        **(env or {}),
    )
    run = [sys.executable, str(HERE / "engine_run.py"), str(model), "1", load_format, str(out), "dtype=float16"]
    result = run_engine_script(run, env)
    log = result.stdout + result.stderr
    data: dict[str, Any] = json.loads(out.read_text()) if result.returncode == 0 else {}
    data["log"], data["returncode"] = log, result.returncode
    return data


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen4exp_csf")
    nvfp4, csf = root / "nvfp4", root / "nvfp4_csf"
    quantize_qwen4exp_nvfp4(tiny_checkpoint("qwen4_exp_text"), nvfp4)
    assert csf_convert(["encode", str(nvfp4), str(csf), "--scope", "all", "--quiet"]) == 0
    return {"root": root, "nvfp4": nvfp4, "csf": csf}


@pytest.fixture(scope="module")
def engines(checkpoints: dict[str, Path]) -> dict[str, Any]:
    root = checkpoints["root"]
    device_path = {"CSF_LOADER_DECODE": "triton", "TRITON_INTERPRET": "1"}
    return {
        "source": run_engine(checkpoints["nvfp4"], "auto", root / "source.json"),
        "csf": run_engine(checkpoints["csf"], "csf", root / "csf.json", device_path),
    }


def test_qwen4exp_csf_serves_its_nvfp4_source(engines: dict[str, Any]) -> None:
    src, csf = engines["source"], engines["csf"]
    assert src["returncode"] == 0, src["log"][-6000:]
    assert csf["returncode"] == 0, csf["log"][-6000:]
    assert "portable (qwen38_plugin) implementation" in csf["log"]
    # Every CSF plane went through the Triton kernel (the device path), none through the torch codec.
    assert f"decoded {PLANES} NVFP4-CSF scale planes on cpu with the Triton kernel" in csf["log"], csf["log"][-4000:]
    # in line with stock's copies by default (CSF_LOADER_READ_AHEAD=1 would run it on a thread ahead)
    assert "csf_loader: the weight stream is decoded on a thread ahead of stock's copies" not in csf["log"]
    (rank_src,), (rank_csf,) = src["ranks"], csf["ranks"]
    assert {k: v["sha256"] for k, v in rank_csf.items()} == {k: v["sha256"] for k, v in rank_src.items()}
    assert rank_csf["model.layers.0.linear_attn.in_proj_qkvz.weight_scale"]["dtype"] == "torch.float8_e4m3fn"
    assert rank_csf["model.layers.0.linear_attn.in_proj_qkvz.weight"]["dtype"] == "torch.uint8"  # NVFP4 served
    assert csf["tokens"] == src["tokens"]
    assert csf["logprobs"] == src["logprobs"]  # exact: the same bytes reach the same kernels


def test_ple_tables_keep_the_checkpoints_dtype(engines: dict[str, Any]) -> None:
    # K15: the model runs in fp16, the tables stay in the checkpoint's bf16 (CSF leaves them untouched).
    for run in engines.values():
        assert "dtype=torch.float16" in run["log"]
        assert "stored as bfloat16 (the checkpoint's dtype)" in run["log"], run["log"][-4000:]


def broken_copy(csf: Path, out: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the CSF checkpoint with ``change(tensors)`` applied to its shard and the index rebuilt."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(csf, out)
    shard = out / "model.safetensors"
    tensors = load_file(str(shard))
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = dict.fromkeys(sorted(tensors), "model.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


MISSING = "model.layers.1.linear_attn.out_proj.weight_scale"
EXTRA = "model.layers.2.linear_attn.extra_proj.weight_scale"


@pytest.fixture(scope="module")
def broken_loads(checkpoints: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """R40: stock's loader at startup (``load_only.py``: the worker's model build and weight load,
    in one process) on the CSF checkpoint, on a copy missing one compressed plane entirely (both
    streams and their index entries), and on a copy with a CSF pair that decodes into a scale no
    layer of the model has."""
    root = checkpoints["root"]

    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[MISSING + ".nvfp4_csf_fixed"], tensors[MISSING + ".nvfp4_csf_exceptions"]

    def add(tensors: dict[str, torch.Tensor]) -> None:
        for suffix in (".nvfp4_csf_fixed", ".nvfp4_csf_exceptions"):
            tensors[EXTRA + suffix] = tensors["model.layers.2.linear_attn.out_proj.weight_scale" + suffix].clone()

    models = {
        "good": checkpoints["csf"],
        "missing": broken_copy(checkpoints["csf"], root / "missing", drop),
        "unexpected": broken_copy(checkpoints["csf"], root / "unexpected", add),
    }
    cmd = [sys.executable, str(HERE / "load_only.py"), "csf", *map(str, models.values())]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"model"')]
    assert len(lines) == 3, result.stdout[-3000:] + result.stderr[-3000:]
    return dict(zip(models, lines, strict=True))


def test_missing_compressed_tensor_fails_at_startup_naming_it(broken_loads: dict[str, dict[str, Any]]) -> None:
    assert broken_loads["good"] == {"model": broken_loads["good"]["model"], "loaded": True}
    error = broken_loads["missing"].get("error", "")
    assert error.startswith("ValueError: Following weights were not initialized from checkpoint"), error
    assert MISSING in error, error


def test_unexpected_compressed_tensor_fails_at_startup_naming_it(broken_loads: dict[str, dict[str, Any]]) -> None:
    error = broken_loads["unexpected"].get("error", "")
    assert "There is no module or parameter named" in error and "extra_proj" in error, error
