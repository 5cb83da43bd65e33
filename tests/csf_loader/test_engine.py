"""NVFP4-CSF through a real stock vLLM engine on CPU at TP=2: same tensors per rank, same logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from csf_loader.convert import main as csf_convert
from csf_loader.quantize import quantize_checkpoint
from tests.engines import IN_PROCESS, run_engine_script

SCRIPT = Path(__file__).with_name("engine_run.py")


def run_engine(model: Path, tp: int, load_format: str, out: Path) -> dict[str, Any]:
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        **IN_PROCESS,
    )
    cmd = [sys.executable, str(SCRIPT), str(model), str(tp), load_format, str(out)]
    result = run_engine_script(cmd, env, cores=tp, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    data: dict[str, Any] = json.loads(out.read_text())
    data["log"] = result.stdout + result.stderr
    return data


@pytest.fixture(scope="module")
def nvfp4_source(tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("csf_engine_source") / "nvfp4"
    quantize_checkpoint(Path(tiny_checkpoint("qwen3")), source, "nvfp4")
    return source


@pytest.fixture(scope="module")
def engines(nvfp4_source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("csf_engine")
    source = nvfp4_source
    csf = root / "nvfp4_csf"
    assert csf_convert(["encode", str(source), str(csf), "--scope", "all", "--quiet"]) == 0
    return {
        "source_dir": source,
        "source": run_engine(source, 2, "auto", root / "source.json"),
        "csf": run_engine(csf, 2, "csf", root / "csf.json"),
    }


def test_csf_engine_logits_equal_uncompressed(engines: dict[str, Any]) -> None:
    src, csf = engines["source"], engines["csf"]
    # 14 planes per rank; the 10 TP-split ones (q, o, gate, up, down) decoded from the compressed
    # payload only over this rank's extent (k and v are replicated: one KV head at TP=2).
    decoded = "decoded 14 NVFP4-CSF scale planes on cpu with the torch codec (10 of them only this rank's TP extent"
    assert decoded in csf["log"]
    assert csf["tokens"] == src["tokens"]
    assert csf["logprobs"] == src["logprobs"]  # exact: same bytes reach the same kernels


def test_every_rank_holds_the_source_slices(engines: dict[str, Any]) -> None:
    src, csf = engines["source"], engines["csf"]
    assert len(csf["ranks"]) == 2
    # Every parameter on every rank is byte-identical to the uncompressed load.
    for rank_src, rank_csf in zip(src["ranks"], csf["ranks"], strict=True):
        assert {k: v["sha256"] for k, v in rank_csf.items()} == {k: v["sha256"] for k, v in rank_src.items()}
    # And each rank's scales are its TP slice of the source checkpoint's E4M3 bytes.
    with safe_open(str(engines["source_dir"] / "model.safetensors"), "pt") as f:
        source = {k: f.get_tensor(k).view(torch.uint8).tolist() for k in f.keys() if k.endswith("weight_scale")}  # noqa: SIM118
    for layer in (0, 1):
        p = f"model.layers.{layer}"
        q, k, v = (source[f"{p}.self_attn.{n}_proj.weight_scale"] for n in "qkv")
        o = source[f"{p}.self_attn.o_proj.weight_scale"]
        gate, up = source[f"{p}.mlp.gate_proj.weight_scale"], source[f"{p}.mlp.up_proj.weight_scale"]
        down = source[f"{p}.mlp.down_proj.weight_scale"]
        hq, hm, oc, dc = len(q) // 2, len(gate) // 2, len(o[0]) // 2, len(down[0]) // 2
        for r, rank in enumerate(csf["ranks"]):
            # One KV head at TP=2: vLLM replicates it on both ranks.
            assert rank_scale(rank, f"{p}.self_attn.qkv_proj") == q[r * hq : (r + 1) * hq] + k + v
            assert rank_scale(rank, f"{p}.mlp.gate_up_proj") == gate[r * hm : (r + 1) * hm] + up[r * hm : (r + 1) * hm]
            assert rank_scale(rank, f"{p}.self_attn.o_proj") == [row[r * oc : (r + 1) * oc] for row in o]
            assert rank_scale(rank, f"{p}.mlp.down_proj") == [row[r * dc : (r + 1) * dc] for row in down]


def rank_scale(rank: dict[str, Any], module: str) -> list[list[int]]:
    entry = rank[f"{module}.weight_scale"]
    rows, cols = entry["shape"]
    return [entry["bytes"][i * cols : (i + 1) * cols] for i in range(rows)]


def broken_copy(source_dir: Path, out_dir: Path, change: Any) -> Path:
    """A copy of ``source_dir`` with ``change(tensors)`` applied to its weights."""
    from safetensors.torch import save_file

    out_dir.mkdir()
    for path in source_dir.iterdir():
        if path.suffix != ".safetensors":
            (out_dir / path.name).write_bytes(path.read_bytes())
    with safe_open(str(source_dir / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    change(tensors)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


MISSING = "model.layers.1.mlp.down_proj.weight_scale_2"
EXTRA = "model.layers.0.mlp.down_proj.weight_scale_3"


@pytest.fixture(scope="module")
def broken_loads(nvfp4_source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """R40 for standard NVFP4 checkpoints loaded with ``--load-format csf`` (weights tracking on):
    stock's loader at startup (``load_only.py``: the worker's model build and weight load, in one
    process) on a copy missing a tensor and on one with a tensor the model has no parameter for."""
    root = tmp_path_factory.mktemp("csf_engine_broken")
    models = {
        "missing": broken_copy(nvfp4_source, root / "missing", lambda t: t.pop(MISSING)),
        "unexpected": broken_copy(nvfp4_source, root / "unexpected", lambda t: t.update({EXTRA: torch.ones(1)})),
    }
    cmd = [sys.executable, str(SCRIPT.with_name("load_only.py")), "csf", *map(str, models.values())]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"model"')]
    assert len(lines) == 2, result.stdout[-3000:] + result.stderr[-3000:]
    return {name: line.get("error", "<loaded>") for name, line in zip(models, lines, strict=True)}


def test_missing_tensor_fails_at_startup_naming_it(broken_loads: dict[str, str]) -> None:
    # R40: a standard NVFP4 checkpoint with a tensor missing fails at startup and names the parameter.
    error = broken_loads["missing"]
    assert "were not initialized from checkpoint" in error, error
    assert "model.layers.1.mlp.down_proj.weight_global_scale" in error or "down_proj.weight_scale_2" in error, error


def test_unexpected_tensor_fails_at_startup_naming_it(broken_loads: dict[str, str]) -> None:
    # R40: a tensor the model has no parameter for fails at startup, named by stock's
    # AutoWeightsLoader (relative to the inner model, which drops the "model." prefix).
    error = broken_loads["unexpected"]
    assert "There is no module or parameter named 'layers.0.mlp.down_proj.weight_scale_3'" in error, error
