"""A tiny AWQ checkpoint built from a tiny fp16 one, and its dequantized fp16 twin.

Every selected linear weight (``W [out, in]``) is quantized AWQ-style (`awq_reference.quantize_awq`
of ``W.T``) into ``qweight`` / ``qzeros`` / ``scales``; config.json gains ``quantization_config``
(quant_method awq, bits 4, the group size, zero_point true). The twin holds
``dequantize(...).T`` in place of each weight: the fp16 model the AWQ one must equal.

Selection (``quantize``, a regex searched in each tensor name): by default every decoder linear
layer of a dense or MoE Qwen3 (`DECODER_LINEARS`). For the tiny Qwen3.8 Flash-Next (Qwen4Exp)
`QWEN4EXP_QUANTIZED` selects what an AutoAWQ Flash-Next quantizes, with `QWEN4EXP_NOT_CONVERTED`
as its ``modules_to_not_convert``:

* quantized: the Gated DeltaNet ``in_proj_qkv`` / ``in_proj_z`` (vLLM's ``in_proj_qkvz``) and
  ``out_proj``, the QSA ``q_proj`` / ``k_proj`` / ``v_proj`` (``qkv_proj``) and ``o_proj``, the
  routed experts, the shared expert, the PLE ``key_proj`` / ``value_proj``;
* not converted: the router ``mlp.gate`` and the ``shared_expert_gate`` (vLLM builds both
  unquantized), the hyper-connection mixers and the QSA ``indexer`` (the portable model's fused
  kernels read their plain weights; the indexer is built with ``quant_config=None``), and
  ``in_proj_b`` / ``in_proj_a`` (6 output rows each in the tiny model, not the multiple of 8 that
  the SM70 AWQ kernels need; a full-size Flash-Next's 48 would do). Norms, PLE tables,
  embeddings and lm_head are not linear layers of the decoder and stay as they are.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sm70_backend.kernels import awq_reference as ref
from tests.conftest import building

DECODER_LINEARS = r"\.layers\..*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
QWEN4EXP_QUANTIZED = (
    r"\.layers\.\d+\.(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|self_attn\.[qkvo]_proj"
    r"|mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj|ple\.(key|value)_proj)\.weight$"
)
QWEN4EXP_NOT_CONVERTED = ["mlp.gate", "shared_expert_gate", "hyper_connection", "indexer", "in_proj_b", "in_proj_a"]


def quantization_config(group_size: int = 32, **overrides: Any) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            **overrides}  # fmt: skip


def build_awq_pair(
    source: Path,
    out: Path,
    group_size: int = 32,
    qconfig: dict[str, Any] | None = None,
    quantize: str = DECODER_LINEARS,
) -> tuple[Path, Path]:
    """(awq_dir, dequantized_dir) under ``out``, built once; ``quantize`` selects the weights."""
    with building(out):
        return _build_awq_pair(source, out, group_size, qconfig, quantize)


def _build_awq_pair(
    source: Path, out: Path, group_size: int, qconfig: dict[str, Any] | None, quantize: str
) -> tuple[Path, Path]:
    awq_dir, fp16_dir = out / "awq", out / "dequantized"
    if awq_dir.is_dir() and fp16_dir.is_dir():
        return awq_dir, fp16_dir
    selected = re.compile(quantize)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for d in (tmp / "awq", tmp / "dequantized"):
        shutil.copytree(source, d, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        cast = t.to(torch.float16) if t.is_floating_point() else t
        if selected.search(name):
            qweight, qzeros, scales = ref.quantize_awq(cast.T.contiguous(), group_size)
            base = name.removesuffix(".weight")
            quantized.update({f"{base}.qweight": qweight, f"{base}.qzeros": qzeros, f"{base}.scales": scales})
            dequantized[name] = ref.dequantize(qweight, qzeros, scales).T.contiguous()
        else:
            quantized[name] = cast
            dequantized[name] = cast
    save_file(quantized, str(tmp / "awq" / "model.safetensors"))
    save_file(dequantized, str(tmp / "dequantized" / "model.safetensors"))
    for d, qc in ((tmp / "awq", qconfig or quantization_config(group_size)), (tmp / "dequantized", None)):
        config = json.loads((d / "config.json").read_text())
        config["dtype"] = "float16"
        config.pop("torch_dtype", None)
        if qc is not None:
            config["quantization_config"] = qc
        (d / "config.json").write_text(json.dumps(config, indent=2))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("awq", "dequantized"):
        shutil.rmtree(out / name, ignore_errors=True)
        (tmp / name).rename(out / name)
    shutil.rmtree(tmp, ignore_errors=True)
    return awq_dir, fp16_dir
