"""The tiny-checkpoint builder: deterministic, complete, loadable, and strict about bad configs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM, Qwen4ExpForCausalLM

from qwen38_plugin.configs import register_transformers_model_aliases
from qwen38_plugin.tiny import checkpoints
from qwen38_plugin.tiny.checkpoints import TinyCheckpointError, build_tiny_checkpoint

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_same_seed_gives_identical_bytes_and_other_seeds_differ(tmp_path: Path) -> None:
    first = build_tiny_checkpoint(tmp_path / "a", "qwen4_exp_text", seed=7)
    second = build_tiny_checkpoint(tmp_path / "b", "qwen4_exp_text", seed=7)
    third = build_tiny_checkpoint(tmp_path / "c", "qwen4_exp_text", seed=8)
    assert set(digests(first)) == EXPECTED_FILES
    assert digests(first) == digests(second)
    assert digests(first)["model.safetensors"] != digests(third)["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


def _chat_ids(directory: Path) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "user", "content": "Tell me about the sea, the moon and the tides, in some detail please."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def test_qwen4_exp_checkpoint_has_every_block_and_runs_in_transformers(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    directory = tiny_checkpoint("qwen4_exp_text")
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "qwen4_exp_text" and config["architectures"] == ["Qwen4ExpForCausalLM"]
    assert set(config["layer_types"]) == {"linear_attention", "indexed_attention"}
    assert config["ple_layer_ids"] and config["indexer_budget"] and config["hc_count"] > 1 and config["num_experts"] > 1
    model = Qwen4ExpForCausalLM.from_pretrained(directory, dtype=torch.float32)
    names = {name for name, _ in model.named_parameters()}
    for block in (
        "linear_attn.",
        "self_attn.indexer.",
        "attn_hyper_connection.",
        "ple.",
        "mlp.experts",
        "mlp.shared_expert",
    ):
        assert any(block in name for name in names), block
    # HF initialises RMSNorm weights (used as 1 + w) and the PLE conv to zero; ours are random.
    for name, param in model.named_parameters():
        assert param.any(), f"{name} is all zeros"
    ids = _chat_ids(directory)
    assert ids.shape[1] > config["indexer_budget"]  # long enough for QSA to select blocks
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"]) and torch.isfinite(logits).all()


def test_renamed_checkpoint_is_the_same_model(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    official = tiny_checkpoint("qwen4_exp_text")
    renamed = tiny_checkpoint("qwen3_8_flash_next_text")
    official_config = json.loads((official / "config.json").read_text())
    renamed_config = json.loads((renamed / "config.json").read_text())
    assert renamed_config.pop("model_type") == "qwen3_8_flash_next_text"
    official_config.pop("model_type")
    assert renamed_config == official_config
    assert digests(renamed)["model.safetensors"] == digests(official)["model.safetensors"]
    register_transformers_model_aliases()
    ids = _chat_ids(official)
    with torch.no_grad():
        a = Qwen4ExpForCausalLM.from_pretrained(official, dtype=torch.float32)(input_ids=ids).logits
        b = Qwen4ExpForCausalLM.from_pretrained(renamed, dtype=torch.float32)(input_ids=ids).logits
    assert torch.equal(a, b)


def test_qwen3_checkpoint_generates(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    directory = tiny_checkpoint("qwen3")
    model = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = _chat_ids(directory)
    out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)


@pytest.mark.parametrize(
    ("model_type", "overrides", "field"),
    [
        ("qwen4_exp_text", {"num_key_value_heads": 3}, "num_key_value_heads"),
        ("qwen4_exp_text", {"linear_num_key_heads": 4}, "linear_num_key_heads"),
        ("qwen4_exp_text", {"indexer_budget": 18}, "indexer_budget"),
        ("qwen4_exp_text", {"indexer_budget": 8192}, "indexer_budget"),
        ("qwen4_exp_text", {"indexer_kv_heads": 2}, "indexer_kv_heads"),
        ("qwen4_exp_text", {"indexer_head_dim": 8}, "indexer_head_dim"),
        ("qwen4_exp_text", {"ple_layer_ids": [4]}, "ple_layer_ids"),
        ("qwen4_exp_text", {"ple_embed_dim": 30}, "ple_embed_dim"),
        (
            "qwen4_exp_text",
            {"layer_types": ["linear_attention", "mamba", "linear_attention", "indexed_attention"]},
            "layer_types",
        ),
        ("qwen4_exp_text", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("qwen4_exp_text", {"hc_count": 1}, "hc_count"),
        ("qwen3", {"vocab_size": 1000}, "vocab_size"),
        ("qwen3", {"hidden_size": 0}, "hidden_size"),
        ("llama", {}, "model_type"),
    ],
)
def test_impossible_configs_are_rejected_naming_the_field(
    tmp_path: Path, model_type: str, overrides: dict[str, object], field: str
) -> None:
    with pytest.raises(TinyCheckpointError, match=rf"^{field}: "):
        build_tiny_checkpoint(tmp_path / "out", model_type, overrides=overrides)
    assert list(tmp_path.iterdir()) == []


def test_failed_build_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_write(directory: Path, model_max_length: int) -> None:
        (directory / "tokenizer.json").write_text("{")  # a partial file, then the failure
        raise OSError("disk full")

    monkeypatch.setattr(checkpoints, "write_tokenizer", failing_write)
    with pytest.raises(OSError, match="disk full"):
        build_tiny_checkpoint(tmp_path / "out", "qwen4_exp_text")
    assert list(tmp_path.iterdir()) == []


def test_existing_directory_is_not_overwritten_silently(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(TinyCheckpointError, match=r"^out_dir: .* already exists"):
        build_tiny_checkpoint(tmp_path / "out", "qwen3")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_cli_reports_bad_input_without_traceback(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "qwen38_plugin.tiny.cli", str(tmp_path / "out")]
    bad = subprocess.run([*cli, "--set", "indexer_budget=18"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "qwen38-tiny-checkpoint: indexer_budget: 18 is not a multiple of indexer_compress_ratio=4"
    )
    good = subprocess.run([*cli, "--model-type", "qwen3", "--seed", "3"], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert Path(good.stdout.strip()) == tmp_path / "out"
    assert set(digests(tmp_path / "out")) == EXPECTED_FILES
