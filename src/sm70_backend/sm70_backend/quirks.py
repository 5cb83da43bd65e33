"""SM70 platform quirks as plain functions (no vLLM import): the SM70 platform applies them in
`check_and_update_config` (`sm70_backend.platform`); the tests call them directly.

- bf16 on SM70 (R59): a V100 has no bf16 arithmetic; a bf16 checkpoint runs in fp16, said in one
  log line. Values of the checkpoint outside fp16's range (|x| > 65504) would become inf when cast:
  they are found by scanning the checkpoint's tensors before the load and reported per tensor
  (``VLLM_SM70_FP16_RANGE_CHECK``: warn / error / off), never clipped silently.
- Multimodal default (R14): with FLASH_ATTN_V100 and no ``--limit-mm-per-prompt``, a request
  may carry 1 image and no video (``Using SM70 Flash-V100 multimodal default``); a limit that
  leaves out "video" disables video.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

FP16_MAX = 65504.0
SM70_MM_DEFAULT = {"image": 1, "video": 0}
MM_DEFAULT_LOG = "Using SM70 Flash-V100 multimodal default"


def run_dtype_on_sm70(requested: torch.dtype, capability: tuple[int, int]) -> tuple[torch.dtype, str | None]:
    """The dtype to run (fp16 for bf16 below compute capability 8.0) and the one log line saying so."""
    if requested == torch.bfloat16 and capability < (8, 0):
        major, minor = capability
        return torch.float16, (
            f"sm70_backend: bfloat16 runs as float16 on compute capability {major}.{minor} (no bfloat16 "
            f"arithmetic there); checkpoint values outside float16's range (|x| > {FP16_MAX:g}) are reported "
            f"at load (VLLM_SM70_FP16_RANGE_CHECK)"
        )
    return requested, None


@dataclass(frozen=True)
class RangeViolation:
    name: str
    count: int  # elements with |x| > FP16_MAX (finite in the source dtype)
    max_abs: float

    def __str__(self) -> str:
        return f"{self.name}: {self.count} values beyond ±{FP16_MAX:g} (largest |x| {self.max_abs:.6g})"


def fp16_range_violations(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[RangeViolation]:
    """Floating-point tensors with finite values float16 cannot hold (they would become ±inf)."""
    found = []
    for name, tensor in tensors:
        if not tensor.is_floating_point() or tensor.dtype == torch.float16 or tensor.numel() == 0:
            continue
        magnitude = tensor.detach().abs()
        beyond = torch.isfinite(magnitude) & (magnitude > FP16_MAX)
        count = int(beyond.sum())
        if count:
            found.append(RangeViolation(name, count, float(magnitude[beyond].max())))
    return found


def checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a directory's safetensors files, one at a time (memory-mapped)."""
    from safetensors import safe_open

    directory = Path(model_dir)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    for file in files:
        with safe_open(str(directory / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                yield name, f.get_tensor(name)


def fp16_range_report(violations: list[RangeViolation], limit: int = 20) -> str:
    lines = [str(v) for v in violations[:limit]]
    if len(violations) > limit:
        lines.append(f"... and {len(violations) - limit} more tensors")
    return (
        f"sm70_backend: {len(violations)} checkpoint tensors hold values outside float16's range; in float16 they "
        f"become ±inf:\n  " + "\n  ".join(lines)
    )


def sm70_mm_limits(user_limits: dict[str, int] | None) -> tuple[dict[str, int], str | None]:
    """The per-request limits FLASH_ATTN_V100 runs with, and the log line when they differ from the user's.

    None or {} (no --limit-mm-per-prompt): 1 image, no video. A limit without "video": video off.
    """
    if not user_limits:
        return dict(SM70_MM_DEFAULT), (
            f"{MM_DEFAULT_LOG}: 1 image and no video per request; set --limit-mm-per-prompt (including "
            f'"video") to change it'
        )
    if "video" not in user_limits:
        limits = {**user_limits, "video": 0}
        return limits, (
            f'{MM_DEFAULT_LOG}: --limit-mm-per-prompt leaves out "video", so video is disabled; include '
            f'"video" to allow it'
        )
    return dict(user_limits), None
