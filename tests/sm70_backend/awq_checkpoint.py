"""A tiny AWQ checkpoint built from a tiny fp16 one, and its dequantized fp16 twin.

Every linear weight of the decoder layers (``W [out, in]``) is quantized AWQ-style
(`awq_reference.quantize_awq` of ``W.T``) into ``qweight`` / ``qzeros`` / ``scales``; config.json
gains ``quantization_config`` (quant_method awq, bits 4, the group size, zero_point true).
The twin holds ``dequantize(...).T`` in place of each weight: the fp16 model the AWQ one must equal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sm70_backend.kernels import awq_reference as ref

LINEAR_SUFFIXES = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
    "gate_proj.weight", "up_proj.weight", "down_proj.weight",
)  # fmt: skip


def quantization_config(group_size: int = 32, **overrides: Any) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            **overrides}  # fmt: skip


def build_awq_pair(
    source: Path, out: Path, group_size: int = 32, qconfig: dict[str, Any] | None = None
) -> tuple[Path, Path]:
    """(awq_dir, dequantized_dir) under ``out``, built once."""
    awq_dir, fp16_dir = out / "awq", out / "dequantized"
    if awq_dir.is_dir() and fp16_dir.is_dir():
        return awq_dir, fp16_dir
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
        if name.endswith(LINEAR_SUFFIXES) and ".layers." in name:
            qweight, qzeros, scales = ref.quantize_awq(t.to(torch.float16).T.contiguous(), group_size)
            base = name.removesuffix(".weight")
            quantized.update({f"{base}.qweight": qweight, f"{base}.qzeros": qzeros, f"{base}.scales": scales})
            dequantized[name] = ref.dequantize(qweight, qzeros, scales).T.contiguous()
        else:
            quantized[name] = t.to(torch.float16)
            dequantized[name] = t.to(torch.float16)
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
