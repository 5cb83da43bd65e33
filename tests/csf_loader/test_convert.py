"""csf-convert: layout as the format says, byte identity, verify, atomic output, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from csf_loader.convert import main
from tests.csf_loader.test_codec import spec_decode
from tests.csf_loader.toy_checkpoints import make_mxfp4_moe, make_nvfp4_moe

CLI = [sys.executable, "-m", "csf_loader.convert"]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def raw_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor's (dtype, shape, bytes), read through the safetensors library."""
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + length])
    header.pop("__metadata__", None)
    data = path.read_bytes()[8 + length :]
    return {n: (i["dtype"], i["shape"], data[i["data_offsets"][0] : i["data_offsets"][1]]) for n, i in header.items()}


def test_nvfp4_encode_layout_identity_verify_decode(tmp_path: Path) -> None:
    src = make_nvfp4_moe(tmp_path / "src")
    dst = tmp_path / "csf"
    assert main(["encode", str(src), str(dst), "--quiet"]) == 0
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        before, after = raw_tensors(src / shard), raw_tensors(dst / shard)
        for name, (dtype, shape, data) in before.items():
            compressed = ".experts." in name and name.endswith(".weight_scale")
            if not compressed:
                assert after[name] == (dtype, shape, data), name  # byte-identical
                assert index[name] == shard
                continue
            assert name not in after and name not in index
            fixed, words = after[name + ".nvfp4_csf_fixed"], after[name + ".nvfp4_csf_exceptions"]
            assert fixed[0] == "U8" and fixed[1] == [shape[0] // 16, 16 * (1 + shape[1] // 2)]
            assert words[0] == "U32"
            word_list = list(struct.unpack(f"<{len(words[2]) // 4}I", words[2]))
            got = spec_decode(fixed[2], word_list, shape[0], shape[1], 4)
            assert bytes(v for row in got for v in row) == data, name
            assert index[name + ".nvfp4_csf_fixed"] == index[name + ".nvfp4_csf_exceptions"] == shard
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MIXED_PRECISION"
    assert qc["exclude_modules"] == ["lm_head"]
    layers = qc["quantized_layers"]
    assert layers["model.layers.0.mlp.experts"] == {
        "quant_algo": "NVFP4",
        "group_size": 16,
        "weight_scale_encoding": "csf",
    }
    assert layers["model.layers.1.self_attn.o_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert "weight_scale_encoding" not in layers["model.layers.1.mlp.shared_expert.up_proj"]
    assert (dst / "tokenizer.json").read_text() == "{}"

    assert main(["verify", str(dst), "--source", str(src), "--quiet"]) == 0
    back = tmp_path / "back"
    assert main(["decode", str(dst), str(back), "--quiet"]) == 0
    for path in src.iterdir():
        assert sha(back / path.name) == sha(path), path.name
    assert sorted(p.name for p in back.iterdir()) == sorted(p.name for p in src.iterdir())


def test_mxfp4_container_layout_and_round_trip(tmp_path: Path) -> None:
    src = make_mxfp4_moe(tmp_path / "src")
    dst = tmp_path / "csf"
    assert main(["encode", str(src), str(dst), "--quiet"]) == 0
    assert not (dst / "model.safetensors.index.json").exists()
    manifest = json.loads((dst / "manifest.json").read_text())
    contract = json.loads((dst / "build-contract.json").read_text())
    for doc in (manifest, contract):
        assert doc["schema"] == "lil-mxfp4-csf-checkpoint/1"
        assert doc["codec"] == "row-base-offset1-u24-exceptions/1"
        assert doc["family"] == "toy_mx" and doc["compressed_layers"] == [1, 3]
    assert [s["file"] for s in manifest["shards"]] == ["model.safetensors"]
    assert set(contract["source_names"].values()) == {"model.safetensors"}
    shard = dst / "tensors" / "model.safetensors"
    with safe_open(str(shard), "pt") as f:
        assert f.metadata()["schema"] == "lil-mxfp4-csf-checkpoint/1"
        assert f.metadata()["codec"] == "row-base-offset1-u24-exceptions/1"
    receipt = json.loads((dst / "receipts" / "model.safetensors.json").read_text())
    assert receipt["source_sha256"] == sha(src / "model.safetensors")
    before, after = raw_tensors(src / "model.safetensors"), raw_tensors(shard)
    stacked = "model.layers.1.mlp.experts.gate_up_proj_scales"
    info = receipt["tensors"][stacked]
    assert info["shape"] == [3, 32, 8] and info["source_bytes"] == 3 * 32 * 8
    assert info["fixed_bytes"] == len(after[stacked + ".mxfp4_csf_fixed"][2]) == 96 * (1 + 1)
    for name, (dtype, shape, data) in before.items():
        if name in receipt["tensors"]:
            rows, cols = (shape[0] * shape[1], shape[2]) if len(shape) == 3 else tuple(shape)
            fixed, words = after[name + ".mxfp4_csf_fixed"], after[name + ".mxfp4_csf_exceptions"]
            assert fixed[1] == [rows // 16 * 16 * (1 + (cols + 7) // 8)]
            word_list = list(struct.unpack(f"<{len(words[2]) // 4}I", words[2]))
            got = spec_decode(fixed[2], word_list, rows, cols, 1)
            assert bytes(v for row in got for v in row) == data, name
        else:
            assert after[name] == (dtype, shape, data)
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp4_csf" and qc["source_quant_method"] == "mxfp4"
    assert main(["verify", str(dst), "--source", str(src), "--quiet"]) == 0
    assert main(["decode", str(dst), str(tmp_path / "back"), "--quiet"]) == 0
    assert sha(tmp_path / "back" / "model.safetensors") == sha(src / "model.safetensors")
    assert sha(tmp_path / "back" / "config.json") == sha(src / "config.json")


def test_verify_detects_a_changed_byte_and_a_missing_partner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_nvfp4_moe(tmp_path / "src")
    dst = tmp_path / "csf"
    assert main(["encode", str(src), str(dst), "--quiet"]) == 0
    shard = dst / "model-00002-of-00002.safetensors"
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale.nvfp4_csf_fixed"
    blob = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", blob[:8])
    begin = json.loads(blob[8 : 8 + length])[name]["data_offsets"][0]
    blob[8 + length + begin + 20] ^= 0x01  # a code nibble in the first slab
    shard.write_bytes(bytes(blob))
    assert main(["verify", str(dst), "--quiet"]) == 1
    assert "model-00002-of-00002.safetensors: rebuilt source shard SHA-256 differs" in capsys.readouterr().err

    # Drop a tensor's exception stream: the error names the file and the tensor.
    tensors = {}
    with safe_open(str(shard), "pt") as f:
        for k in f.keys():  # noqa: SIM118
            if not k.endswith("experts.0.gate_proj.weight_scale.nvfp4_csf_exceptions"):
                tensors[k] = f.get_tensor(k)
    save_file(tensors, str(shard))
    assert main(["verify", str(dst), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_scale.nvfp4_csf_exceptions is missing" in err


def test_bad_sources_fail_naming_file_and_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_nvfp4_moe(tmp_path / "src")
    shard = src / "model-00002-of-00002.safetensors"
    full = shard.read_bytes()
    shard.write_bytes(full[: len(full) - 100])  # truncated
    dst = tmp_path / "out"
    assert main(["encode", str(src), str(dst), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "model-00002-of-00002.safetensors: tensor" in err and "truncated" in err
    assert not dst.exists() and not list(tmp_path.glob(".out.csf-partial-*"))

    shard.write_bytes(struct.pack("<Q", 40) + b"{not json" + b" " * 31 + full[48:])
    assert main(["encode", str(src), str(dst), "--quiet"]) == 2
    assert "corrupt safetensors header" in capsys.readouterr().err

    shard.write_bytes(full)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["x"] = "model-00003-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["encode", str(src), str(dst), "--quiet"]) == 2
    assert "names shard model-00003-of-00002.safetensors, which is missing" in capsys.readouterr().err
    assert not dst.exists()


def test_container_with_manifest_naming_a_missing_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_mxfp4_moe(tmp_path / "src")
    dst = tmp_path / "csf"
    assert main(["encode", str(src), str(dst), "--quiet"]) == 0
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["shards"].append({"file": "model-2.safetensors"})
    (dst / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", str(dst), "--quiet"]) == 2
    assert "names shard model-2.safetensors, missing from" in capsys.readouterr().err


def test_existing_destination_is_refused_and_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_nvfp4_moe(tmp_path / "src")
    dst = tmp_path / "csf"
    dst.mkdir()
    (dst / "keep").write_text("x")
    assert main(["encode", str(src), str(dst), "--quiet"]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert (dst / "keep").read_text() == "x"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_conversion_leaves_no_checkpoint(tmp_path: Path, sig: signal.Signals) -> None:
    src = make_nvfp4_moe(tmp_path / "src")
    # Padding tensors make the run long enough to be interrupted mid-way.
    for i in range(6):
        save_file({f"pad{i}": torch.zeros(64 * 1024 * 1024 // 4)}, str(src / f"pad-{i}.safetensors"))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"].update({f"pad{i}": f"pad-{i}.safetensors" for i in range(6)})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    dst = tmp_path / "csf"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([*CLI, "encode", str(src), str(dst)], env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    # Wait until it has written output (the first progress line), then interrupt it.
    line = proc.stderr.readline()
    assert "csf-convert encode" in line, line
    partial = list(tmp_path.glob(".csf.csf-partial-*"))
    assert partial, "conversion writes into a temporary sibling"
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not dst.exists()
    if sig == signal.SIGTERM:
        assert not list(tmp_path.glob(".csf.csf-partial-*"))
    # A later run succeeds and removes what a killed run left.
    started = time.monotonic()
    assert main(["encode", str(src), str(dst), "--quiet"]) == 0
    assert not list(tmp_path.glob(".csf.csf-partial-*"))
    assert main(["verify", str(dst), "--quiet"]) == 0
    assert time.monotonic() - started < 120


def test_wrong_scale_dtype_or_shape_in_the_source_fails_naming_the_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_nvfp4_moe(tmp_path / "src")
    shard = src / "model-00001-of-00002.safetensors"
    with safe_open(str(shard), "pt") as f:
        good = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    name = "model.layers.0.mlp.experts.1.down_proj.weight_scale"
    save_file({**good, name: good[name].float()}, str(shard))
    assert main(["encode", str(src), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"model-00001-of-00002.safetensors: tensor {name}: F32 [48, 4]; a NVFP4 block scale" in err
    save_file({**good, name: good[name][:, :2].contiguous()}, str(shard))
    assert main(["encode", str(src), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "tensor model.layers.0.mlp.experts.1.down_proj.weight: shape [48, 32] does not match its scale" in err
    assert not (tmp_path / "out").exists()
