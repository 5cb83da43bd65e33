"""Tiny random HF checkpoints with the real Qwen3.6 tokenizer, for tests and the demo.

Three kinds (`MODEL_TYPES`):
- `qwen4_exp_text`: transformers' `Qwen4ExpForCausalLM` with every Qwen3.8 Flash-Next block
  (Gated DeltaNet, QSA indexed attention, hyper-connections, PLE, MoE), small enough that a
  CPU forward takes milliseconds;
- `qwen3_8_flash_next_text`: the same model under the renamed model type;
- `qwen3`: a tiny standard `Qwen3ForCausalLM` for harness smoke tests.

A checkpoint is a pure function of (model type, overrides, seed): the same inputs give
byte-identical files. Every weight is random, norms and the PLE convolution included (HF
initialises those to zero, which would make them invisible to any test).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from qwen38_plugin.tiny.tokenizer import EOS_TOKEN, PAD_TOKEN, special_token_ids, write_tokenizer

VOCAB_SIZE = 248_320  # Qwen4Exp's vocabulary: the 248,077 tokenizer ids padded to a multiple of 256

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {
        **_COMMON,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "qwen4_exp_text": {
        **_COMMON,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
        # Flash-Next's geometry, scaled down: few KV heads, 3 GDN value heads per key head.
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 6,
        "hc_count": 4,
        "hc_lowrank": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "ple_layer_ids": [1, 2],
        "ple_embed_dim": 64,
        "ngram_size": 3,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 1000,
        "split_ngram_parts": 2,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 32,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
    },
}
DEFAULTS["qwen3_8_flash_next_text"] = DEFAULTS["qwen4_exp_text"]

MODEL_TYPES = tuple(DEFAULTS)


class TinyCheckpointError(ValueError):
    """An impossible tiny-checkpoint configuration; the message names the field."""


def tiny_config_dict(model_type: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The validated config fields of a tiny checkpoint (defaults updated by `overrides`)."""
    if model_type not in DEFAULTS:
        raise TinyCheckpointError(f"model_type: unknown {model_type!r}; choose one of {', '.join(MODEL_TYPES)}")
    fields = {**DEFAULTS[model_type], **(overrides or {})}
    ids = special_token_ids()
    fields.setdefault("eos_token_id", ids[EOS_TOKEN])
    fields.setdefault("pad_token_id", ids[PAD_TOKEN])
    _validate(model_type, fields)
    return fields


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise TinyCheckpointError(f"{field}: {message}")


def _validate(model_type: str, f: dict[str, Any]) -> None:
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        _require(isinstance(f[name], int) and f[name] > 0, name, f"must be a positive integer, got {f[name]!r}")
    _require(
        f["num_attention_heads"] % f["num_key_value_heads"] == 0,
        "num_key_value_heads",
        f"{f['num_key_value_heads']} does not divide num_attention_heads={f['num_attention_heads']}",
    )
    max_id = max(special_token_ids().values())
    _require(
        f["vocab_size"] > max_id,
        "vocab_size",
        f"{f['vocab_size']} cannot hold the tokenizer's ids (largest {max_id}); use at least {max_id + 1}",
    )
    if model_type == "qwen3":
        return
    layer_types = f.get("layer_types")
    _require(
        layer_types is None or len(layer_types) == f["num_hidden_layers"],
        "layer_types",
        f"has {len(layer_types or [])} entries for num_hidden_layers={f['num_hidden_layers']}",
    )
    unknown = sorted(set(layer_types or []) - {"linear_attention", "indexed_attention"})
    _require(not unknown, "layer_types", f"unknown layer types {unknown}; use linear_attention or indexed_attention")
    _require(
        f["linear_num_value_heads"] % f["linear_num_key_heads"] == 0,
        "linear_num_key_heads",
        f"{f['linear_num_key_heads']} does not divide linear_num_value_heads={f['linear_num_value_heads']}",
    )
    _require(
        0 < f["num_experts_per_tok"] <= f["num_experts"],
        "num_experts_per_tok",
        f"must be in [1, num_experts={f['num_experts']}], got {f['num_experts_per_tok']}",
    )
    _require(f["hc_count"] > 1, "hc_count", f"Qwen4Exp needs more than one residual stream, got {f['hc_count']}")
    if f.get("indexer_budget") is not None:
        budget, ratio = f["indexer_budget"], f["indexer_compress_ratio"]
        _require(f.get("indexer_kv_heads") == 1, "indexer_kv_heads", "QSA supports exactly 1 indexer key head")
        _require(
            isinstance(ratio, int) and ratio > 0 and budget % ratio == 0,
            "indexer_budget",
            f"{budget} is not a multiple of indexer_compress_ratio={ratio}",
        )
        _require(
            budget <= f["max_position_embeddings"],
            "indexer_budget",
            f"{budget} exceeds max_position_embeddings={f['max_position_embeddings']}",
        )
        rotary = int(f["head_dim"] * f["rope_parameters"].get("partial_rotary_factor", 1.0))
        _require(
            rotary <= f["indexer_head_dim"],
            "indexer_head_dim",
            f"{f['indexer_head_dim']} is smaller than the attention's rotary dimension {rotary}",
        )
    if f.get("ple_layer_ids"):
        ngram_heads = (f["ngram_size"] - 1) * f["heads_per_ngram"]
        _require(
            ngram_heads > 0 and f["ple_embed_dim"] % ngram_heads == 0,
            "ple_embed_dim",
            f"{f['ple_embed_dim']} is not a multiple of the {ngram_heads} n-gram heads",
        )
        bad = [i for i in f["ple_layer_ids"] if not 1 <= i <= f["num_hidden_layers"]]
        _require(not bad, "ple_layer_ids", f"{bad} are not one-indexed layer ids in [1, {f['num_hidden_layers']}]")
        if layer_types:
            bad = [i for i in f["ple_layer_ids"] if layer_types[i - 1] != "linear_attention"]
            _require(not bad, "ple_layer_ids", f"layers {bad} are not linear_attention layers; PLE needs them")


def _build_model(model_type: str, fields: dict[str, Any]) -> PreTrainedModel:
    if model_type == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(architectures=["Qwen3ForCausalLM"], **fields))
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    config_cls: type[Qwen4ExpTextConfig] = Qwen4ExpTextConfig
    if model_type == "qwen3_8_flash_next_text":
        from qwen38_plugin.configs import Qwen3_8FlashNextTextConfig, register_transformers_model_aliases

        register_transformers_model_aliases()
        config_cls = Qwen3_8FlashNextTextConfig
    return Qwen4ExpForCausalLM(config_cls(architectures=["Qwen4ExpForCausalLM"], **fields))


def _randomize_zero_initialised(model: torch.nn.Module, generator: torch.Generator) -> None:
    # HF starts RMSNorm weights (used as 1 + w) and the PLE convolution at zero; random values
    # make every block contribute, so tests notice when one is computed wrongly.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_floating_point() and not param.any():
                scale = 0.1 if "norm" in name else 0.5
                param.copy_(torch.randn(param.shape, generator=generator, device=generator.device) * scale)


def _add_mtp_weights(
    path: Path, fields: dict[str, Any], dtype: torch.dtype, seed: int, text_prefix: str = "model.", device: str = "cpu"
) -> None:
    """Random ``mtp.*`` tensors (the multi-token-prediction head stock vLLM's `Qwen4ExpMTP` loads)
    for ``mtp_num_hidden_layers`` QSA decoder layers, named as the checkpoint's first
    ``indexed_attention`` layer; norms around 0 (used as 1 + w), linear weights of 1 / sqrt(fan-in)."""
    from safetensors.torch import load_file, save_file

    layer_types = fields.get("layer_types") or []
    _require(
        "indexed_attention" in layer_types, "mtp_num_hidden_layers", "the MTP layer is a QSA layer: layer_types "
        "needs an indexed_attention layer to take its tensor names from",
    )  # fmt: skip
    source = f"{text_prefix}layers.{layer_types.index('indexed_attention')}."
    tensors = load_file(str(path))
    hidden, width = fields["hidden_size"], fields["hidden_size"] * fields["hc_count"]
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.fc_embedding.weight": (hidden, hidden),
        "mtp.fc_hidden.weight": (hidden, hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (width,),
        "mtp.hyper_connection_mixer.hc_norm.weight": (width,),
        "mtp.hyper_connection_mixer.input_mix_weight_down.weight": (fields["hc_lowrank"], width),
        "mtp.hyper_connection_mixer.input_mix_weight_up.weight": (width, fields["hc_lowrank"]),
    }
    for n in range(int(fields["mtp_num_hidden_layers"])):
        for name, tensor in sorted(tensors.items()):
            if name.startswith(source):
                shapes[f"mtp.layers.{n}.{name.removeprefix(source)}"] = tuple(tensor.shape)
    generator = torch.Generator(device).manual_seed(seed + 1)
    for name, shape in shapes.items():
        scale = 0.1 if "norm" in name or len(shape) == 1 else shape[-1] ** -0.5
        tensors[name] = (torch.randn(shape, generator=generator, device=device) * scale).to(dtype).cpu()
    save_file(tensors, str(path), metadata={"format": "pt"})


def add_mtp_head(path: str | Path, num_layers: int = 1, seed: int = 0) -> Path:
    """Give the checkpoint directory ``path`` (a tiny text or multimodal Qwen4Exp, one safetensors
    file) a random MTP head of ``num_layers`` layers in place: ``mtp_num_hidden_layers`` in its
    (text) config and the ``mtp.*`` tensors in the weights' dtype."""
    from safetensors import safe_open

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = num_layers
    (weights,) = path.glob("*.safetensors")
    with safe_open(str(weights), "pt") as f:
        dtype = f.get_slice("lm_head.weight").get_dtype()
    torch_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype]
    prefix = "model.language_model." if "text_config" in config else "model."
    _add_mtp_weights(weights, text, torch_dtype, seed, text_prefix=prefix)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def build_tiny_checkpoint(
    out_dir: str | Path,
    model_type: str = "qwen4_exp_text",
    *,
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    device: str = "cpu",
) -> Path:
    """Write a tiny random checkpoint (weights, config, tokenizer, chat template) to `out_dir`.

    The directory appears complete or not at all: files are written to a sibling temporary
    directory that is renamed into place. ``device`` is where the random weights are drawn: a
    benchmark's model of Flash-Next's widths (10 G parameters) takes minutes on a CPU and seconds on
    a GPU; the same seed gives other values on another device.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise TinyCheckpointError(f"out_dir: {out} already exists; pass overwrite=True (--overwrite) to replace it")
    torch_dtype = getattr(torch, dtype, None)
    _require(
        isinstance(torch_dtype, torch.dtype) and torch_dtype in (torch.float32, torch.float16, torch.bfloat16),
        "dtype",
        f"{dtype!r} is not one of float32, float16, bfloat16",
    )
    fields = tiny_config_dict(model_type, overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = _build_model(model_type, fields)
    _randomize_zero_initialised(model, torch.Generator(device).manual_seed(seed))
    model.to(torch_dtype)  # type: ignore[arg-type]  # transformers wraps .to() with an imprecise signature
    model.config.dtype = dtype

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        if fields.get("mtp_num_hidden_layers"):
            assert isinstance(torch_dtype, torch.dtype)
            _add_mtp_weights(staging / "model.safetensors", fields, torch_dtype, seed, device=device)
        ids = special_token_ids()
        generation = {"eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]], "pad_token_id": ids[PAD_TOKEN]}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        write_tokenizer(staging, model_max_length=fields["max_position_embeddings"])
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
