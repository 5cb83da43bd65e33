"""Where a decode step of the portable model goes, without vLLM: step time, lm_head time, top ops.

    .venv/bin/python benchmarks/qwen38_plugin/profile_decode_step.py [--dtype float32|bfloat16] [--threads 1]

Uses bench_cpu.py's medium checkpoint (built by bench_cpu.py under .cache/bench/): 8 sequences
after 128-token prompts, one decode step of all 8 (mean of 5), then the lm_head alone on the same
batch, then torch's profiler over one step (ops by self CPU time).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src" / "qwen38_plugin"))

from qwen38_plugin.model import DictStateStore, Qwen4ExpCore, SequenceCache, iter_safetensors  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-kernels", action="store_true", help="with vLLM's CPU kernels, as inside vLLM")
    args = parser.parse_args()
    from transformers import AutoConfig

    path = ROOT / ".cache" / "bench" / "qwen4_exp_text-medium"
    if not path.exists():
        raise SystemExit(f"{path} is missing: run bench_cpu.py --config medium once to build it")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    core = Qwen4ExpCore(AutoConfig.from_pretrained(path)).to(dtype)
    core.load_checkpoint_tensors(iter_safetensors(path))
    core.eval()
    if args.vllm_kernels:
        from qwen38_plugin import vllm_cpu_kernels

        print(vllm_cpu_kernels.install(core))
    gen = torch.Generator().manual_seed(0)
    batch, prompt_len = 8, 128
    prompts = [torch.randint(0, 240_000, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    store = DictStateStore(core, [SequenceCache() for _ in prompts])
    with torch.no_grad():
        ids = torch.tensor([t for p in prompts for t in p])
        hidden = core.forward_step(ids, torch.arange(prompt_len).repeat(batch), [prompt_len] * batch, store)
        state = {"next": core.logits(hidden[torch.arange(batch) * prompt_len + prompt_len - 1]).argmax(-1),
                 "pos": prompt_len}  # fmt: skip

        def step() -> None:
            out = core.forward_step(state["next"], torch.full((batch,), state["pos"]), [1] * batch, store)
            state["next"], state["pos"] = core.logits(out).argmax(-1), state["pos"] + 1

        step()
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        per_step = (time.perf_counter() - t0) / 5
        x = torch.randn(batch, core.config.hidden_size).to(dtype)
        t0 = time.perf_counter()
        for _ in range(5):
            core.logits(x)
        lm_head = (time.perf_counter() - t0) / 5
        print(f"{args.dtype}, {args.threads} thread(s): decode step of {batch} sequences {per_step * 1e3:.0f} ms, "
              f"of which lm_head {lm_head * 1e3:.0f} ms")  # fmt: skip
        from torch.profiler import profile

        with profile() as prof:
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main()
