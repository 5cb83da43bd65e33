"""Standard NVFP4 (ModelOpt layout) and MXFP4 (OCP MX) weight quantization (no vLLM).

Used to make test and measurement checkpoints from real or tiny bf16 weights. The
recipes are the published ones, with round-to-nearest E2M1:
* NVFP4: ``weight_scale_2 = amax(W) / (6 * 448)`` (fp32), per 16 values an E4M3
  ``weight_scale = amax(block) / 6 / weight_scale_2``, codes = W / (scale * scale_2).
  Weights ``uint8 [out, in / 2]``, low nibble first.
* MXFP4: per 32 values a UE8M0 exponent ``floor(log2(amax(block))) - 2`` (E2M1's
  largest exponent), codes = W / 2**exponent, saturated at 6.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from csf_loader.layout import experts_module

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_MAX = 448.0


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float values to the nearest E2M1 code (sign bit 8, magnitude index 0..7)."""
    mag = x.abs().clamp(max=6.0)
    mids = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2
    index = torch.bucketize(mag, mids.to(mag))
    sign = (x < 0).to(torch.uint8) << 3
    return (index.to(torch.uint8) | sign) & 0xF


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def e2m1_decode(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], -1).long()
    value = E2M1_VALUES[codes & 7]
    return torch.where(codes >= 8, -value, value)


def quantize_nvfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 tensors for one [out, in] weight: weight, weight_scale, weight_scale_2."""
    w = weight.float()
    out_f, in_f = w.shape
    if in_f % 16:
        raise ValueError(f"NVFP4 needs in_features % 16 == 0, got {in_f}")
    blocks = w.reshape(out_f, in_f // 16, 16)
    scale_2 = (w.abs().amax() / (6.0 * E4M3_MAX)).clamp(min=1e-12)
    scale = (blocks.abs().amax(-1) / 6.0 / scale_2).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = scale.float() * scale_2
    q = blocks / torch.where(denom == 0, torch.ones_like(denom), denom).unsqueeze(-1)
    codes = e2m1_codes(q).reshape(out_f, in_f)
    return {"weight": pack_nibbles(codes), "weight_scale": scale, "weight_scale_2": scale_2.reshape(())}


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    values = e2m1_decode(packed)
    out_f, in_f = values.shape
    return (values.reshape(out_f, in_f // 16, 16) * (scale.float() * scale_2.float()).unsqueeze(-1)).reshape(
        out_f, in_f
    )


def quantize_mxfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """OCP MXFP4 tensors for one [..., in] weight: packed E2M1 ``weight`` and UE8M0 ``scale`` bytes."""
    w = weight.float()
    in_f = w.shape[-1]
    if in_f % 32:
        raise ValueError(f"MXFP4 needs in_features % 32 == 0, got {in_f}")
    blocks = w.reshape(*w.shape[:-1], in_f // 32, 32)
    amax = blocks.abs().amax(-1)
    exponent = torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - 2
    exponent = exponent.clamp(-127, 127)
    q = blocks / torch.exp2(exponent).unsqueeze(-1)
    codes = e2m1_codes(q).reshape(w.shape)
    return {"weight": pack_nibbles(codes), "scale": (exponent + 127).to(torch.uint8)}


LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def unquantized_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """ModelOpt's ``ignore`` list: every module with a 2-D floating ``weight`` left unquantized,
    each layer's routed experts as one ``<layer>.mlp.experts*`` wildcard (as ModelOpt writes it)."""
    names = set()
    for name, t in tensors.items():
        if name.endswith(".weight") and t.dim() == 2 and t.is_floating_point():
            module = name.removesuffix(".weight")
            experts = experts_module(module)
            names.add(experts + "*" if experts else module)
    return sorted(names)


def quantize_checkpoint(
    src: Path,
    dst: Path,
    fmt: str,
    input_scale: float = 1.0 / 448.0,
    linear_suffixes: tuple[str, ...] = LINEAR_SUFFIXES,
    skip: str | None = None,
    device: str = "cpu",
) -> list[str]:
    """Quantize the decoder linears of a bf16 HF checkpoint directory; return their module names.

    A 2-D ``<module>.weight`` is quantized when the module's last name is in ``linear_suffixes``
    and the module does not match the regular expression ``skip``. NVFP4 writes ModelOpt tensors
    (``weight``, ``weight_scale``, ``weight_scale_2``, ``input_scale``) and ``quant_method:
    modelopt, quant_algo: NVFP4`` with every module left unquantized in ``ignore``; MXFP4 writes
    ``weight`` (packed E2M1) and ``weight_scale`` (UE8M0 bytes) with ``quant_method: mxfp4``.
    Embeddings, norms and lm_head stay in their dtype. ``input_scale`` is a fixed calibration
    constant (there is no calibration data here). ``device`` is where the arithmetic runs (a GPU
    is faster for large checkpoints; its rounding of ``log2`` may differ from the CPU's, so a
    checkpoint built on each need not be byte-identical).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    skipped = re.compile(skip) if skip else None
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(name)
                module = name.removesuffix(".weight")
                chosen = module.rsplit(".", 1)[-1] in linear_suffixes and not (skipped and skipped.search(module))
                if name.endswith(".weight") and chosen and t.dim() == 2:
                    modules.append(module)
                    if fmt == "nvfp4":
                        q = {k: v.cpu() for k, v in quantize_nvfp4(t.to(device)).items()}
                        tensors[name] = q["weight"]
                        tensors[module + ".weight_scale"] = q["weight_scale"]
                        tensors[module + ".weight_scale_2"] = q["weight_scale_2"].float()
                        tensors[module + ".input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
                    elif fmt == "mxfp4":
                        q = {k: v.cpu() for k, v in quantize_mxfp4(t.to(device)).items()}
                        tensors[name] = q["weight"]
                        tensors[module + ".weight_scale"] = q["scale"]
                    else:
                        raise ValueError(f"unknown format {fmt!r}")
                else:
                    tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if fmt == "nvfp4":
        config["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "ignore": unquantized_modules(tensors),  # config.json spelling (hf_quant_config.json: exclude_modules)
        }
    else:
        config["quantization_config"] = {"quant_method": "mxfp4", "group_size": 32}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in src.iterdir():
        if extra.is_file() and not extra.name.endswith(".safetensors") and extra.name != "config.json":
            shutil.copy2(extra, dst / extra.name)
    return modules
