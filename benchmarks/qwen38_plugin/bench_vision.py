"""The Qwen4Exp vision tower as the portable multimodal model runs it (vLLM's Qwen3-VL
``Qwen3_VisionTransformer``) against transformers' ``Qwen4ExpVisionModel``, same weights, same
image, in one run: images per second through the tower for each and the ratio.

    python benchmarks/qwen38_plugin/bench_vision.py [--pixels 1048576] [--depth 27]
        [--dtype float32] [--repeats 3] [--threads N]

The geometry is Flash-Next's (transformers' ``Qwen4ExpVisionConfig`` defaults: 27 blocks, hidden
1152, 16 heads, patch 16, 2 x 2 merge); ``--depth`` cuts the blocks for a quick run on a small CPU.
The image is square, ``--pixels`` pixels (1,048,576: the 1-megapixel budget the plugin resizes to,
4,096 patches, 1,024 tokens for the text model). Runs on CUDA when it is there (fp16 / bf16 with
``--dtype``), else on CPU. Also printed: the tower's FLOPs per image and the rate achieved, so a
number can be set against the machine's peak.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch


def build(depth: int, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any, Any]:
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    single_rank()
    config: Any = Qwen4ExpVisionConfig(depth=depth)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    theirs: Any = Qwen4ExpVisionModel(config)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.02)
    theirs = theirs.to(device=device, dtype=dtype).eval()
    with set_current_vllm_config(VllmConfig()):
        ours = Qwen3_VisionTransformer(config, norm_eps=1e-6, prefix="visual")
    ours.load_weights((name, tensor.clone()) for name, tensor in theirs.state_dict().items())
    for module in ours.modules():  # what vLLM's loader does after loading (CPU: oneDNN prepacking)
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(module)
    ours = ours.to(device=device, dtype=dtype).eval()
    return config, ours, theirs


def single_rank() -> None:
    """vLLM's distributed state for one rank, which its parallel layers need outside an engine."""
    import tempfile

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    method = f"file://{tempfile.mkdtemp()}/init"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, distributed_init_method=method, local_rank=0, backend=backend)
        initialize_model_parallel(1, 1)


def tower_flops(config: Any, patches: int) -> float:
    """Multiply-adds x 2 of one image: patch embedding, the blocks (projections, MLP, attention
    over all patches of the image), the merger."""
    h, inter, merge = config.hidden_size, config.intermediate_size, config.spatial_merge_size**2
    embed = patches * config.in_channels * config.temporal_patch_size * config.patch_size**2 * h
    block = patches * (4 * h * h + 2 * h * inter) + 2 * patches * patches * h
    merger = (patches // merge) * (merge * h * merge * h + merge * h * config.out_hidden_size)
    return 2.0 * (embed + config.depth * block + merger)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pixels", type=int, default=1_048_576)
    parser.add_argument("--depth", type=int, default=27)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    config, ours, theirs = build(args.depth, dtype, device)
    side = math.isqrt(args.pixels) // (config.patch_size * config.spatial_merge_size)
    side *= config.spatial_merge_size  # patches per side, a multiple of the merge size
    grid = torch.tensor([[1, side, side]], device=device)  # transformers indexes its embeddings with it
    patches = side * side
    values = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.randn(patches, values, generator=torch.Generator().manual_seed(1)).to(device, dtype)

    def timed(fn: Any) -> float:
        times = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    with torch.no_grad():
        want = theirs(pixels, grid).pooler_output
        got = ours(pixels, grid.tolist())
    error = float((got.float() - want.float()).norm() / want.float().norm())
    ours_s = timed(lambda: ours(pixels, grid.tolist()))
    theirs_s = timed(lambda: theirs(pixels, grid))
    flops = tower_flops(config, patches)
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"{where}, {args.dtype}, depth {config.depth}, image {side * config.patch_size} x {side * config.patch_size} "
        f"({patches} patches, {patches // config.spatial_merge_size**2} tokens), {flops / 1e9:.0f} GFLOP per image"
    )
    print(f"merged features: relative difference {error:.1e}")
    print("| tower | s per image | images/s | GFLOP/s | vs transformers |")
    print("|---|---|---|---|---|")
    for name, seconds in (("vLLM Qwen3_VisionTransformer (portable model)", ours_s), ("transformers", theirs_s)):
        rate = flops / seconds / 1e9
        print(f"| {name} | {seconds:.3f} | {1 / seconds:.2f} | {rate:.0f} | {theirs_s / seconds:.2f}x |")


if __name__ == "__main__":
    main()
