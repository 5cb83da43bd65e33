"""MXFP4-CSF through a real stock vLLM engine on CPU at TP=1 and TP=2.

A tiny Qwen3-MoE checkpoint's routed experts are quantized to standard MXFP4 and converted
to an MXFP4-CSF container (manifest, build contract, receipts, family table with its
compressed layer range). The engine loads it with ``--load-format csf`` and the plugin's
``mxfp4_csf`` quantization config, i.e. into stock's ``Mxfp4MoEMethod``. Every rank's
parameters right after stock's weight loading (what stock's MXFP4 method registered and
received, before its kernel-specific ``process_weights_after_loading``) must equal, byte
for byte, that rank's slices of the uncompressed MXFP4 source.

Stock's only CPU MXFP4 MoE kernel needs AMX tiles. On a CPU with AMX the TP=1 engine serves the
container and the uncompressed MXFP4 source is served too: greedy tokens, top-5 logprobs and every
parameter after stock's weight processing are identical. Without AMX, stock refuses to build its
MXFP4 MoE method ("No MXFP4 MoE backend supports the deployment configuration") before any
weight is loaded; the test hook (``mxfp4_hook/sitecustomize.py``) then reports AMX as present so
that loading, weight processing and KV-cache setup run, the engines stop before their first
forward (which would execute AMX instructions), and the forward test is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from csf_loader.convert import main as csf_convert
from tests.csf_loader.tiny_moe import build_mxfp4_moe
from tests.engines import IN_PROCESS, run_engine_script

HERE = Path(__file__).parent
LAYERS, EXPERTS = 2, 4
AMX = torch.cpu._is_amx_tile_supported()


def start_engine(model: Path, tp: int, dump: Path, load_format: str = "csf", forward: bool = False) -> dict[str, Any]:
    """Start stock vLLM on ``model``; with ``forward`` it also generates (needs AMX). Returns
    engine_run.py's result with the log."""
    dump.mkdir()
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        CSF_TEST_DUMP_DIR=str(dump),
        CSF_TEST_FAKE_AMX="1",
        **IN_PROCESS,
        PYTHONPATH=os.pathsep.join([str(HERE / "mxfp4_hook"), os.environ.get("PYTHONPATH", "")]),
    )
    out = dump / "engine.json"
    run = [sys.executable, str(HERE / "engine_run.py"), str(model), str(tp), load_format, str(out)]
    cmd = [*run, *([] if forward else ["load-only"])]
    result = run_engine_script(cmd, env, cores=tp, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    data: dict[str, Any] = json.loads(out.read_text())
    assert forward or data == {"started": True}
    data["log"] = log
    return data


@pytest.fixture(scope="module")
def mxfp4_engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("csf_mxfp4_engine")
    source = build_mxfp4_moe(root)
    csf = root / "qwen3_moe_mxfp4_csf"
    assert csf_convert(["encode", str(source), str(csf), "--quiet"]) == 0
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    runs = {tp: start_engine(csf, tp, root / f"tp{tp}", forward=AMX and tp == 1) for tp in (1, 2)}
    source_run = start_engine(source, 1, root / "source", "auto", forward=True) if AMX else None
    ranks = {}
    for tp in (1, 2):
        for rank in range(tp):
            with safe_open(str(root / f"tp{tp}" / f"rank{rank}.safetensors"), "pt") as f:
                ranks[tp, rank] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    logs = {tp: run["log"] for tp, run in runs.items()}
    return {"csf": csf, "source": tensors, "logs": logs, "ranks": ranks, "runs": runs, "source_run": source_run}


def expected_rank_tensors(src: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Every layer parameter of rank ``rank`` at TP ``tp``, cut from the source checkpoint's bytes."""

    def part(t: torch.Tensor, dim: int) -> torch.Tensor:
        size = t.shape[dim] // tp
        return t.narrow(dim, rank * size, size)

    out: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        experts = f"{p}.mlp.experts"

        def stack(proj: str, suffix: str, dim: int, experts: str = experts) -> torch.Tensor:
            return torch.stack([part(src[f"{experts}.{e}.{proj}.{suffix}"], dim) for e in range(EXPERTS)])

        for suffix in ("weight", "weight_scale"):
            # w13 = [gate; up] (column-parallel rows), w2 = down (row-parallel: packed columns / scale columns).
            out[f"{experts}.routed_experts.w13_{suffix}"] = torch.cat(
                [stack("gate_proj", suffix, 0), stack("up_proj", suffix, 0)], dim=1
            )
            out[f"{experts}.routed_experts.w2_{suffix}"] = stack("down_proj", suffix, 1)
        attn = f"{p}.self_attn"
        # One KV head: replicated on both ranks; query heads split.
        q, k, v = (src[f"{attn}.{n}_proj.weight"] for n in "qkv")
        out[f"{attn}.qkv_proj.weight"] = torch.cat([part(q, 0), k, v])
        out[f"{attn}.o_proj.weight"] = part(src[f"{attn}.o_proj.weight"], 1)
        for name in ("mlp.gate", "input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            out[f"{p}.{name}.weight"] = src[f"{p}.{name}.weight"]
    return out


def test_container_loads_into_stocks_mxfp4_moe_method(mxfp4_engines: dict[str, Any]) -> None:
    manifest = json.loads((mxfp4_engines["csf"] / "manifest.json").read_text())
    assert manifest["family"] == "qwen3_moe" and manifest["compressed_layers"] == [0, LAYERS]
    for log in mxfp4_engines["logs"].values():
        # Stock's MXFP4 MoE method with its CPU experts was built for the `mxfp4_csf` config.
        assert "Using 'CPU' Mxfp4 MoE backend" in log, log[-4000:]
        assert "quantization=mxfp4_csf" in log, log[-4000:]


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_each_rank_receives_the_source_bytes(mxfp4_engines: dict[str, Any], tp: int, rank: int) -> None:
    got = mxfp4_engines["ranks"][tp, rank]
    expected = expected_rank_tensors(mxfp4_engines["source"], tp, rank)
    layer_params = {k for k in got if ".layers." in k}
    assert layer_params == set(expected)
    for name, want in expected.items():
        have = got[name]
        assert have.dtype == want.dtype and have.shape == want.shape, (name, have.dtype, have.shape, want.shape)
        assert torch.equal(have.view(torch.uint8), want.contiguous().view(torch.uint8)), name


@pytest.mark.skipif(not AMX, reason="stock's CPU MXFP4 MoE kernel needs AMX tiles, which this CPU lacks")
def test_container_serves_the_tokens_of_its_mxfp4_source(mxfp4_engines: dict[str, Any]) -> None:
    csf, source = mxfp4_engines["runs"][1], mxfp4_engines["source_run"]
    assert csf["tokens"] == source["tokens"]
    assert csf["logprobs"] == source["logprobs"]  # exact: the same bytes reach the same kernel
    # Every parameter after stock's weight processing for its CPU kernel is identical too.
    assert {k: v["sha256"] for k, v in csf["ranks"][0].items()} == {
        k: v["sha256"] for k, v in source["ranks"][0].items()
    }
    # Stock's own weight-loading timer covers the container's stream (it was the seconds since boot).
    took = [line for line in csf["log"].splitlines() if "Loading weights took" in line]
    assert took and float(took[0].split("took ")[1].split(" seconds")[0]) < 600, took
