"""Time to first token of a chat request with one 1-megapixel image, against the same request
without the image, through stock vLLM's OpenAI server (the module `vllm serve` runs, a subprocess
on a free loopback port, with this checkout's plugins) serving the tiny random
`Qwen4ExpForConditionalGeneration` of tests/qwen38_plugin/mm_checkpoint.py, asked with the
`openai` client, streaming:

    python benchmarks/qwen38_plugin/bench_mm_ttft.py [--device-dtype float32] [--repeats 5]
        [--side 1024] [--out DIR]

The checkpoint is the tests' (the tiny text model; a one-block vision tower, hidden 32, with
Flash-Next's patch geometry: patch 16, 2 x 2 merge, temporal patch 2), so the numbers are what vLLM
adds around the model for an image (decoding the data URL, transformers' processor, the tower,
M-RoPE positions, a 1,024-token prefill) more than the cost of Flash-Next's tower (for that see
bench_vision.py). The image is a `--side` x `--side` noise picture (PNG, base64 data URL, made
before the clock starts), a new one (another seed) for every request, and the server runs without
prefix caching, so no request is served from a cache. Time to first token is the time from sending
the request to the first streamed chunk that carries a choice (vLLM sends it with the engine's
first output); each figure is the median of ``--repeats`` requests after one warm-up request of
each kind. Runs on CUDA when there is a GPU (``--device-dtype float16``), else on CPU (float32).
Writes DIR/bench_mm_ttft.json and prints a table.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: the repository's tests and tools packages

TEXT = "Describe this picture in one sentence, please."
STEPS = 8


def image_url(side: int, seed: int) -> str:
    from tests.qwen38_plugin.mm_inputs import make_image

    buffer = io.BytesIO()
    make_image(side, side, seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def ask(client: Any, model: str, content: list[dict[str, Any]]) -> dict[str, float]:
    """One streamed chat request: seconds to the first chunk with a choice and to the end, and the
    prompt's token count (the server's usage report)."""
    start = time.perf_counter()
    first = None
    prompt_tokens = completion_tokens = -1
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=STEPS, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            prompt_tokens, completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
    total = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the server's stream ended without a choice")
    if completion_tokens != STEPS:
        raise RuntimeError(f"the server generated {completion_tokens} tokens, not {STEPS}")
    return {"ttft_s": first, "total_s": total, "prompt_tokens": prompt_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device-dtype", help="the server's --dtype (default: float16 on CUDA, float32 on CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--side", type=int, default=1024, help="the image's width and height in pixels")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args()
    import torch
    from openai import OpenAI

    from tests.qwen38_plugin.mm_checkpoint import VISION, mm_model_checkpoint
    from tools.vllm_server import VllmServer

    cuda = torch.cuda.is_available()
    dtype = args.device_dtype or ("float16" if cuda else "float32")
    if cuda and dtype == "float32":
        parser.error("--device-dtype float32 on CUDA: vLLM's GDN prefill kernel has no float32; use float16")
    # a time limit's SIGTERM unwinds through `with server:`, which stops the server (its own session)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = mm_model_checkpoint()
    args.out.mkdir(parents=True, exist_ok=True)
    # one prefill step for the image's prompt (1,024 image tokens at 1 MP); the tiny checkpoint's
    # chat template renders text only (see tests/qwen38_plugin/test_qwen38_mm_server.py)
    server_args = ["--dtype", dtype, "--max-model-len", "2048", "--max-num-batched-tokens", "2048", "--max-num-seqs",
                   "4", "--no-enable-prefix-caching", "--chat-template-content-format", "string"]  # fmt: skip
    server = VllmServer(model, server_args, log_path=args.out / "bench_mm_ttft_server.log",
                        startup_timeout=args.startup_timeout)  # fmt: skip
    started = time.perf_counter()
    with server:
        startup_s = time.perf_counter() - started
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=600)
        name = str(model)
        text: list[dict[str, Any]] = [{"type": "text", "text": TEXT}]
        urls = [image_url(args.side, seed) for seed in range(args.repeats + 1)]  # before any clock starts
        runs: dict[str, list[dict[str, float]]] = {"image": [], "text": []}
        for i, url in enumerate(urls):  # the first of each kind is the warm-up
            for kind, content in (("image", [{"type": "image_url", "image_url": {"url": url}}, *text]), ("text", text)):
                result = ask(client, name, content)
                if i:
                    runs[kind].append(result)
        log = server.log()
    chosen = [line for line in log.splitlines() if "qwen38_plugin chose Qwen4ExpForConditionalGeneration" in line]
    device = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    report: dict[str, Any] = {
        "device": device, "dtype": dtype, "image_side": args.side, "repeats": args.repeats, "max_tokens": STEPS,
        "vision_tower": {k: VISION[k] for k in ("depth", "hidden_size", "patch_size", "spatial_merge_size")},
        "server_startup_s": round(startup_s, 1),
        "implementation": chosen[-1].split("chose ", 1)[-1] if chosen else None,
    }  # fmt: skip
    for kind, results in runs.items():
        report[kind] = {
            "prompt_tokens": results[0]["prompt_tokens"],
            "ttft_s_median": statistics.median(r["ttft_s"] for r in results),
            "total_s_median": statistics.median(r["total_s"] for r in results),
            "ttft_s": [round(r["ttft_s"], 4) for r in results],
        }
    report["image_ttft_minus_text_s"] = report["image"]["ttft_s_median"] - report["text"]["ttft_s_median"]
    (args.out / "bench_mm_ttft.json").write_text(json.dumps(report, indent=2))
    print(f"{device}, {dtype}, server started in {startup_s:.0f} s; {report['implementation']}")
    print(f"median of {args.repeats} requests after a warm-up, {STEPS} tokens generated each")
    print("| request | prompt tokens | time to first token (s) | whole request (s) |")
    print("|---|---|---|---|")
    for kind, label in (("image", f"{args.side} x {args.side} image + text"), ("text", "the same text alone")):
        r = report[kind]
        print(f"| {label} | {r['prompt_tokens']} | {r['ttft_s_median']:.3f} | {r['total_s_median']:.3f} |")
    print(f"the image adds {report['image_ttft_minus_text_s']:.3f} s to the time to first token")


if __name__ == "__main__":
    main()
