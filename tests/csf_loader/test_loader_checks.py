"""Startup checks of the `csf` load format: bad streams, TP geometry, expert parallelism, registration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from csf_loader.codec import NVFP4_CSF, encode
from csf_loader.stream import CsfLoadError, decode_csf_stream
from csf_loader.vllm_loader import check_tp_geometry


def stream_for(name: str, scales: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    plane = encode(scales, NVFP4_CSF)
    return [(name + ".nvfp4_csf_fixed", plane.fixed), (name + ".nvfp4_csf_exceptions", plane.exceptions)]


def scales(seed: int, rows: int = 32, cols: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(90, 130, (rows, cols), generator=g).to(torch.uint8)


def test_stream_decodes_pairs_and_passes_other_tensors_through() -> None:
    w = torch.arange(6, dtype=torch.bfloat16)
    s = scales(1)
    out = dict(decode_csf_stream([("a.weight", w), *stream_for("a.weight_scale", s)]))
    assert set(out) == {"a.weight", "a.weight_scale"}
    assert out["a.weight"] is w
    assert out["a.weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(out["a.weight_scale"].view(torch.uint8), s)


def test_stream_without_partner_names_tensor_and_shard() -> None:
    fixed = stream_for("m.layers.0.mlp.down_proj.weight_scale", scales(2))[:1]
    with pytest.raises(
        CsfLoadError, match=r"model-1.safetensors: m.layers.0.mlp.down_proj.weight_scale.nvfp4_csf_fixed has no partner"
    ):
        list(decode_csf_stream(fixed, {fixed[0][0]: "model-1.safetensors"}))


def test_base_above_limit_and_exception_outside_plane_fail_naming_tensor() -> None:
    name = "m.layers.1.self_attn.o_proj.weight_scale"
    (fn, fixed), (en, words) = stream_for(name, scales(3))
    bad = fixed.clone()
    bad[1, 2] = 241  # base of row 18
    with pytest.raises(CsfLoadError, match=rf"{name}.nvfp4_csf_fixed: row 18 has base 241 above"):
        list(decode_csf_stream([(fn, bad), (en, words)]))
    outside = torch.tensor([32 * 8 | (7 << 24)], dtype=torch.uint32)
    with pytest.raises(CsfLoadError, match=rf"{name}.nvfp4_csf_exceptions: exception position 256 lies outside"):
        list(decode_csf_stream([(fn, fixed), (en, outside)]))
    with pytest.raises(CsfLoadError, match=r"dtype torch.int64, expected torch.uint32"):
        list(decode_csf_stream([(fn, fixed), (en, words.to(torch.int64))]))


class FakeLinear(nn.Module):
    """A module carrying a rank-local NVFP4 scale parameter, as stock's linear methods create."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight_scale = nn.Parameter(torch.zeros(rows, cols, dtype=torch.float8_e4m3fn), requires_grad=False)


def test_tp_geometry_refusal_names_layer_and_constraint() -> None:
    model = nn.Module()
    model.ok = FakeLinear(64, 8)
    check_tp_geometry(model, {"x": "s"}, 2)
    model.down = FakeLinear(64, 3)
    with pytest.raises(CsfLoadError, match=r"TP=4 gives down 48 input channels per rank; .* multiple of 32"):
        check_tp_geometry(model, {"x": "s"}, 4)
    model2 = nn.Module()
    model2.qkv = FakeLinear(40, 8)
    with pytest.raises(CsfLoadError, match=r"qkv 40 output channels per rank; .* multiple of 16"):
        check_tp_geometry(model2, {"x": "s"}, 2)


def test_register_is_idempotent_and_lists_what_it_registered() -> None:
    code = (
        "import csf_loader\n"
        "a = csf_loader.register(); b = csf_loader.register()\n"
        "assert a is b, (a, b)\n"
        "from vllm.model_executor.model_loader import get_model_loader\n"
        "from vllm.config.load import LoadConfig\n"
        "print(type(get_model_loader(LoadConfig(load_format='csf'))).__name__, a)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert "CsfModelLoader" in out.stdout
    assert "load format 'csf'" in out.stdout and "NVFP4 emulation linear kernel for CPU" in out.stdout


def test_expert_parallelism_is_refused_with_a_message() -> None:
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    from csf_loader.vllm_loader import check_parallel_config

    ep = VllmConfig(parallel_config=ParallelConfig(enable_expert_parallel=True))
    refused = pytest.raises(CsfLoadError, match="expert parallelism is not supported for CSF checkpoints")
    with set_current_vllm_config(ep), refused:
        check_parallel_config()
    with set_current_vllm_config(VllmConfig(parallel_config=ParallelConfig())):
        check_parallel_config()


def test_mxfp4_container_stream_yields_the_source_tensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    from csf_loader.convert import main as csf_convert
    from csf_loader.stream import mxfp4_container_stream
    from tests.csf_loader.toy_checkpoints import make_mxfp4_moe

    src = make_mxfp4_moe(tmp_path / "src")
    dst = tmp_path / "csf"
    assert csf_convert(["encode", str(src), str(dst), "--quiet"]) == 0
    got = dict(mxfp4_container_stream(dst))
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        expected = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_mxfp4_container_contract_violations_fail_at_startup(tmp_path: Path) -> None:
    from csf_loader.convert import main as csf_convert
    from csf_loader.stream import read_mxfp4_contract
    from tests.csf_loader.toy_checkpoints import make_mxfp4_moe

    src = make_mxfp4_moe(tmp_path / "src")
    dst = tmp_path / "csf"
    assert csf_convert(["encode", str(src), str(dst), "--quiet"]) == 0
    read_mxfp4_contract(dst)
    manifest_path, contract_path = dst / "manifest.json", dst / "build-contract.json"
    manifest, contract = json.loads(manifest_path.read_text()), json.loads(contract_path.read_text())

    def rewrite(m: dict[str, Any], c: dict[str, Any]) -> None:
        manifest_path.write_text(json.dumps(m))
        contract_path.write_text(json.dumps(c))

    rewrite({**manifest, "schema": "lil-x4t-checkpoint/1"}, contract)
    with pytest.raises(CsfLoadError, match=r"manifest.json: schema 'lil-x4t-checkpoint/1'; this reader accepts only"):
        read_mxfp4_contract(dst)
    narrow = {**manifest, "compressed_layers": [2, 3]}
    rewrite(narrow, {**contract, "compressed_layers": [2, 3]})
    with pytest.raises(CsfLoadError, match=r"model.layers.1.mlp.experts.0.w1.scale lies outside .* \[2, 3\)"):
        read_mxfp4_contract(dst)
    rewrite({**manifest, "shards": [*manifest["shards"], {"file": "model-2.safetensors"}]}, contract)
    with pytest.raises(CsfLoadError, match=r"names shard model-2.safetensors, missing from"):
        read_mxfp4_contract(dst)
    rewrite({**manifest, "family": "other"}, contract)
    with pytest.raises(CsfLoadError, match="must name the same model family"):
        read_mxfp4_contract(dst)


def test_stream_decodes_only_the_rank_extent_when_given() -> None:
    s = scales(5, rows=64, cols=8)
    seen: list[tuple[str, int, int]] = []

    def extent_of(name: str, rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
        seen.append((name, rows, cols))
        return (16, 48), (2, 6)

    out = dict(decode_csf_stream(stream_for("l.weight_scale", s), extent_of=extent_of))
    assert seen == [("l.weight_scale", 64, 8)]
    got = out["l.weight_scale"].view(torch.uint8)
    assert got.shape == (64, 8)
    assert torch.equal(got[16:48, 2:6], s[16:48, 2:6])


def rewrite_shard(path: Path, change: Any) -> None:
    """Rewrite a safetensors shard with ``change(tensors)`` applied (same file name)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_preflight_names_file_and_tensor_for_bad_nvfp4_checkpoints(tmp_path: Path) -> None:
    from csf_loader.convert import main as csf_convert
    from csf_loader.stream import preflight
    from tests.csf_loader.toy_checkpoints import make_nvfp4_moe

    src = make_nvfp4_moe(tmp_path / "src")
    csf = tmp_path / "csf"
    assert csf_convert(["encode", str(src), str(csf), "--quiet"]) == 0
    preflight(str(src))
    preflight(str(csf))
    shard = csf / "model-00002-of-00002.safetensors"
    good = shard.read_bytes()
    expert = "model.layers.1.mlp.experts.3.down_proj"

    shard.write_bytes(good[:-100])  # truncated: the last tensor in the data section is cut
    with pytest.raises(CsfLoadError, match=r"model-00002-of-00002.safetensors: tensor .* truncated"):
        preflight(str(csf))
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + good[24:])
    with pytest.raises(CsfLoadError, match=r"model-00002-of-00002.safetensors: corrupt safetensors header"):
        preflight(str(csf))

    shard.write_bytes(good)
    rewrite_shard(shard, lambda t: t.update({f"{expert}.weight_scale.nvfp4_csf_fixed": torch.zeros(3, 5)}))
    with pytest.raises(CsfLoadError, match=rf"tensor {expert}.weight_scale.nvfp4_csf_fixed: F32 \[3, 5\]; expected U8"):
        preflight(str(csf))
    shard.write_bytes(good)
    rewrite_shard(shard, lambda t: t.update({f"{expert}.weight_scale.nvfp4_csf_exceptions": torch.zeros(2, 2)}))
    with pytest.raises(
        CsfLoadError, match=rf"{expert}.weight_scale.nvfp4_csf_exceptions: F32 \[2, 2\]; expected 1-D U32"
    ):
        preflight(str(csf))
    shard.write_bytes(good)
    rewrite_shard(shard, lambda t: t.update({f"{expert}.weight": t[f"{expert}.weight"][:32]}))
    with pytest.raises(CsfLoadError, match=rf"tensor {expert}.weight: shape \[32, 32\] does not match its scale"):
        preflight(str(csf))

    # The index names a shard that is not there.
    shard.write_bytes(good)
    index = json.loads((csf / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = "model-00003-of-00002.safetensors"
    (csf / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CsfLoadError, match=r"index.json names shard model-00003-of-00002.safetensors, which is missing"
    ):
        preflight(str(csf))

    # A plain NVFP4 scale that does not fit its weight (stock would fail deep in its weight loader).
    plain = src / "model-00001-of-00002.safetensors"
    rewrite_shard(
        plain,
        lambda t: t.update(
            {"model.layers.0.self_attn.o_proj.weight_scale": torch.zeros(48, 2).to(torch.float8_e4m3fn)}
        ),
    )
    with pytest.raises(
        CsfLoadError, match=r"tensor model.layers.0.self_attn.o_proj.weight: shape \[48, 32\] does not match"
    ):
        preflight(str(src))


def test_preflight_checks_mxfp4_container_shards_against_receipts(tmp_path: Path) -> None:
    from csf_loader.convert import main as csf_convert
    from csf_loader.stream import preflight
    from tests.csf_loader.toy_checkpoints import make_mxfp4_moe

    src = make_mxfp4_moe(tmp_path / "src")
    csf = tmp_path / "csf"
    assert csf_convert(["encode", str(src), str(csf), "--quiet"]) == 0
    preflight(str(csf))
    shard = csf / "tensors" / "model.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])
    with pytest.raises(CsfLoadError, match=r"tensors/model.safetensors: tensor .* truncated"):
        preflight(str(csf))
    shard.write_bytes(good)
    receipt_path = csf / "receipts" / "model.safetensors.json"
    receipt = json.loads(receipt_path.read_text())
    name = "model.layers.1.mlp.experts.0.w1.scale"
    receipt["tensors"][name]["shape"] = [48, 3]
    receipt_path.write_text(json.dumps(receipt))
    too_short = rf"{name}.mxfp4_csf_fixed: 64 bytes do not code the receipt's \[48, 3\] scales \(96 bytes\)"
    with pytest.raises(CsfLoadError, match=too_short):
        preflight(str(csf))
