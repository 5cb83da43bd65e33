"""The portable Qwen4Exp inside stock vLLM on a GPU: decode and prefill against the weight-read
roofline and against transformers, measured in one run.

    python benchmarks/qwen38_plugin/bench_gpu.py OUT_DIR [--config medium] [--dtype float16]
        [--batches 1,8,64,256] [--modes eager,graphs,peer] [--stock] [--work DIR]
        [--capture-sizes measured|vllm]

For each mode (``eager``: ``enforce_eager=True``; ``graphs``: vLLM's default for this
architecture on CUDA, breakable CUDA graphs without torch.compile, in vLLM's default GPU model
runner (V2); ``compiled``: torch.compile with piecewise and full CUDA graphs
(``VLLM_USE_BREAKABLE_CUDAGRAPH=0``); ``graphs-v1``: ``graphs`` in the V1 runner, the one the CPU
tests run; ``peer``: see below) and batch size B, ``B`` requests of ``--prompt-len`` random tokens
run together through `vllm.LLM` in a child process: prefill tokens/s from a ``max_tokens=1`` run,
decode tokens/s from ``B * (new_tokens - 1) / (total - prefill time)``, the fastest of ``--repeats``.
transformers' ``Qwen4ExpForCausalLM.generate`` runs the same prompts as one batch on the same kind
of GPU (the second GPU, at the same time, where two are visible; else after vLLM on the first).
With ``--stock``, stock vLLM's own Qwen4Exp (bf16, ``QWEN38_FORCE_PORTABLE=0``) is tried on the
same checkpoint; what stops it is recorded if it does not start. Stock's CUDA top-k kernel takes a
QSA block top-k (``indexer_budget / indexer_compress_ratio``) of 512, 1024 or 2048 only (an H100 run
with the medium config's 64 / 8 = 8 failed in its first prefill, 2026-12-05), so ``--stock`` needs
``--indexer-budget`` (4096 for medium), which every run of the invocation then uses.

The peers (``--modes ...,peer,peer-hybrid``): stock vLLM architectures of the same size run by the
same child with vLLM's defaults for them (no mode environment, so their default model runner,
torch.compile and CUDA graphs), with the tiny builder's 248,320-token vocabulary and its tokenizer
(so detokenizing costs the same). ``peer`` (rows ``peer-qwen3moe``): a random ``Qwen3MoeForCausalLM``
with the geometry of ``--config`` (hidden size, layers, attention heads, KV heads, head dim, experts,
top-k, expert width), every layer full attention and sparse, no shared expert, ``norm_topk_prob``.
``peer-hybrid`` (rows ``peer-qwen3next``): a random ``Qwen3NextForCausalLM``, vLLM's own hybrid of
Gated DeltaNet and gated full attention, with our layer pattern (QSA layers become full attention),
our GDN geometry and shared expert: it pays vLLM's hybrid-model costs (the GDN metadata builder,
mamba state slots and their prefix-cache copies) that a pure-attention model does not. A model this
small spends most of a decode step outside its weights (scheduling, sampling, input preparation,
graph launch), so a fraction of the roofline alone cannot say how much of the gap is ours; the peers
are vLLM's own floor for models of this size, measured on the same GPU in the same run. Each gets its
own roofline (`peer_decode_bytes`, `hybrid_peer_decode_bytes`) and the table adds ours-graphs / peer
decode tok/s per batch. Mode suffix ``-noprefix`` (e.g. ``graphs-noprefix``) turns vLLM's prefix
caching off for our model (for a hybrid model vLLM then skips the mamba state copies of its "align"
mode), to see what that costs a decode step.

The roofline: the bytes a decode step must read at batch B (lm_head, the projections and norms of
every layer, the experts the batch touches in expectation, the shared experts; KV and states are
small at these lengths and left out, which makes the roofline optimistic) over the device-to-device
copy bandwidth measured in the same run (bytes read + written / time). Printed: tokens/s, the
fraction of the roofline and the ratio to transformers. Results: OUT_DIR/bench_gpu.json and a table.

Every engine with CUDA graphs (ours, the peers, stock's) captures the same sizes: by default only the
shapes the run decodes (`capture_sizes`), which cuts a cold engine's graph capture (62 s of a 190 s
start on the H200 with vLLM's 51-size grid) to the few graphs the measurement replays.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "qwen38_plugin"))

from bench_cpu import CONFIGS  # noqa: E402  (the same model geometries as the CPU benchmark)

PEER = "peer-qwen3moe"  # the report's name for the peer's rows
HYBRID_PEER = "peer-qwen3next"  # and the hybrid peer's
# The peer's Qwen3MoeConfig fields taken as they are from our config (after the tiny builder's defaults).
PEER_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size",
               "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")  # fmt: skip
# ... and for the hybrid peer (Qwen3NextConfig) also these.
HYBRID_PEER_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                      "linear_num_value_heads", "shared_expert_intermediate_size", "rope_parameters")  # fmt: skip


def build_checkpoint(work: Path, config: str, dtype: str, stock_gate: bool, indexer_budget: int | None = None) -> Path:
    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint

    overrides = dict(CONFIGS[config])
    if indexer_budget is not None:
        overrides["indexer_budget"] = indexer_budget
    if stock_gate:
        # Stock's GDN layer asserts on an unset output_gate_type; transformers uses hidden_act then.
        overrides["output_gate_type"] = "silu"
    budget = f"-budget{indexer_budget}" if indexer_budget is not None else ""
    path = work / f"ckpt-{config}{budget}-{dtype}{'-stock-gate' if stock_gate else ''}"
    if not path.exists():
        build_tiny_checkpoint(path, "qwen4_exp_text", overrides=overrides, dtype=dtype)
    return path


def peer_config(config: str) -> dict[str, Any]:
    """The peer's Qwen3MoeConfig fields: ``CONFIGS[config]`` as the tiny builder resolves it
    (``tiny`` is all defaults; the vocabulary is the builder's), in Qwen3-MoE's plain form."""
    from qwen38_plugin.tiny.checkpoints import tiny_config_dict

    ours = tiny_config_dict("qwen4_exp_text", CONFIGS[config])
    fields = {key: ours[key] for key in PEER_FIELDS}
    # Every layer sparse (no dense MLP layers, so intermediate_size is unused), no sliding window.
    fields.update(decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, norm_topk_prob=True)
    return fields


def hybrid_peer_config(config: str) -> dict[str, Any]:
    """The hybrid peer's Qwen3NextConfig fields: our geometry (as `peer_config`) plus our GDN heads,
    shared expert and layer pattern, every layer sparse, full attention where we have QSA."""
    from qwen38_plugin.tiny.checkpoints import tiny_config_dict

    ours = tiny_config_dict("qwen4_exp_text", CONFIGS[config])
    fields = {key: ours[key] for key in PEER_FIELDS + HYBRID_PEER_FIELDS}
    fields["layer_types"] = [kind if kind == "linear_attention" else "full_attention" for kind in ours["layer_types"]]
    fields.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    return fields


def build_peer_checkpoint(work: Path, config: str, dtype: str, hybrid: bool = False) -> Path:
    """A random ``Qwen3MoeForCausalLM`` (``Qwen3NextForCausalLM`` with ``hybrid``) of ``config``'s size
    with our tokenizer, built once per work dir (written to a temporary sibling and renamed, so an
    interrupted build is never reused)."""
    name = HYBRID_PEER if hybrid else PEER
    path = work / f"ckpt-{name}-{config}-{dtype}"
    if path.exists():
        return path
    import torch
    import transformers

    from qwen38_plugin.tiny.tokenizer import write_tokenizer

    kind = "Qwen3Next" if hybrid else "Qwen3Moe"
    fields = hybrid_peer_config(config) if hybrid else peer_config(config)
    torch.manual_seed(0)
    config_cls, model_cls = getattr(transformers, f"{kind}Config"), getattr(transformers, f"{kind}ForCausalLM")
    model = model_cls(config_cls(architectures=[f"{kind}ForCausalLM"], **fields))
    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=work))
    try:
        model.save_pretrained(staging)
        # child_vllm loads a tokenizer and detokenizes as it does for our model; the same one here
        # keeps that host work equal on both sides.
        write_tokenizer(staging, model_max_length=fields["max_position_embeddings"])
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second (median of 20)."""
    import torch

    src = torch.randn(2**29, device="cuda")  # 2 GiB of fp32
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 4 / statistics.median(times[5:])


def decode_bytes(config: dict[str, Any], batch: int, elem: int) -> float:
    """Weight bytes one decode step of ``batch`` requests must read (see the module docstring)."""
    h, hc = config["hidden_size"], config["hc_count"]
    width = h * hc
    layers = config["layer_types"]
    params = config["vocab_size"] * h  # lm_head
    params += batch * h  # embedding rows
    hc_mixer = width * config["hc_lowrank"] * 2 + width * (hc + 1)  # down, up, inject, norm
    params += (2 * len(layers) + 1) * hc_mixer
    e, k, inter = config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]
    touched = touched_experts(e, k, batch)
    expert = 3 * h * inter
    for kind in layers:
        if kind == "linear_attention":
            kd = config["linear_num_key_heads"] * config["linear_key_head_dim"]
            vd = config["linear_num_value_heads"] * config["linear_value_head_dim"]
            params += h * (2 * kd + vd) + h * vd + 2 * h * config["linear_num_value_heads"] + vd * h
        else:
            d = config["head_dim"]
            params += h * (2 * config["num_attention_heads"] * d + 2 * config["num_key_value_heads"] * d)
            params += config["num_attention_heads"] * d * h
            params += h * (config["indexer_n_heads"] + 1) * config["indexer_head_dim"]
        params += touched * expert + 3 * h * config["shared_expert_intermediate_size"] + h * (e + 1)
    for _ in config.get("ple_layer_ids") or []:
        params += config["ple_embed_dim"] * (width + h) + 3 * width
    return float(params * elem)


def touched_experts(experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a batch touches in one layer in expectation, routing uniform and independent."""
    return experts * (1 - (1 - top_k / experts) ** batch)


def peer_decode_bytes(config: dict[str, Any], batch: int, elem: int) -> float:
    """Weight bytes one decode step of the peer (its config.json) must read, counted as `decode_bytes`:
    lm_head, the batch's embedding rows, then per layer the q/k/v/o projections, the touched experts,
    the router and the norms."""
    h, d = config["hidden_size"], config["head_dim"]
    # transformers 5 writes num_experts under its canonical name num_local_experts
    e = config["num_local_experts"] if "num_local_experts" in config else config["num_experts"]
    k, inter = config["num_experts_per_tok"], config["moe_intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    params = config["vocab_size"] * h + batch * h + h  # lm_head, embedding rows, final norm
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h  # q, k, v; o
    per_layer += touched_experts(e, k, batch) * 3 * h * inter + h * e  # gate, up, down; router
    per_layer += 2 * h + 2 * d  # input and post-attention norms, q and k norms
    return float((params + config["num_hidden_layers"] * per_layer) * elem)


def hybrid_peer_decode_bytes(config: dict[str, Any], batch: int, elem: int) -> float:
    """Weight bytes one decode step of the hybrid peer (its config.json) must read, counted as
    `decode_bytes`: per GDN layer its projections (qkvz, ba, out), per attention layer q (with its
    gate), k, v, o; per layer the touched experts, the shared expert and its gate, the router."""
    h = config["hidden_size"]
    e = config["num_local_experts"] if "num_local_experts" in config else config["num_experts"]
    k, inter = config["num_experts_per_tok"], config["moe_intermediate_size"]
    params = config["vocab_size"] * h + batch * h + h  # lm_head, embedding rows, final norm
    for kind in config["layer_types"]:
        if kind == "linear_attention":
            kd = config["linear_num_key_heads"] * config["linear_key_head_dim"]
            vd = config["linear_num_value_heads"] * config["linear_value_head_dim"]
            params += h * (2 * kd + 2 * vd) + 2 * h * config["linear_num_value_heads"] + vd * h
        else:
            d, heads, kv_heads = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
            params += h * (2 * heads + 2 * kv_heads) * d + heads * d * h
        params += touched_experts(e, k, batch) * 3 * h * inter + 3 * h * config["shared_expert_intermediate_size"]
        params += h * (e + 1) + 2 * h  # router, shared-expert gate, norms
    return float(params * elem)


def _rates(batch: int, new_tokens: int, prefill_s: float, total_s: float, prompt_len: int) -> dict[str, float]:
    return {
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "decode_tok_s": batch * (new_tokens - 1) / max(total_s - prefill_s, 1e-9),
        "step_ms": 1e3 * max(total_s - prefill_s, 1e-9) / (new_tokens - 1),
    }


CAPTURE_SIZES_HELP = (
    "CUDA-graph capture sizes: 'measured' (default) captures only the shapes the run decodes -- the batch sizes, "
    "the powers of two below the largest (a batch that shrinks pads up to one) and, with speculation, each of "
    "them times 1 + drafts -- plus --prompt-len (batch 1's prefill); 'vllm' keeps vLLM's default grid (about 50 "
    "sizes up to 512 tokens, each captured for every graph mode, most of a cold engine's 60 s of capture)"
)


def capture_sizes(setting: str, batches: list[int], query_len: int = 1, prefill: int | None = None) -> list[int] | None:
    """The ``cudagraph_capture_sizes`` for a benchmark engine, or None for vLLM's default grid.

    The same sizes for our model and its peers, so neither waits in capture for shapes the run never
    decodes; a step of a captured size replays the same graph as it would from vLLM's grid."""
    if setting == "vllm":
        return None
    if setting != "measured":
        raise ValueError(f"--capture-sizes {setting!r}: use 'measured' or 'vllm'")
    largest = max(batches)
    counts = {*batches, *(1 << i for i in range(largest.bit_length()) if 1 << i <= largest)}
    sizes = {n * q for n in counts for q in {1, query_len}}
    if prefill is not None:
        sizes.add(prefill)
    return sorted(sizes)


def timed_greedy(llm: Any, inputs: list[Any], max_tokens: int) -> float:
    """Seconds for vLLM to decode ``inputs`` greedily, ``max_tokens`` each (EOS ignored)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(inputs, params, use_tqdm=False)
    return time.perf_counter() - start


def child_vllm(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {"enforce_eager": args.mode.startswith("eager")}  # else vLLM's default
    if args.mode.endswith("-noprefix"):
        kwargs["enable_prefix_caching"] = False
    sizes = capture_sizes(args.capture_sizes, args.batches, prefill=args.prompt_len)
    if sizes is not None and not kwargs["enforce_eager"]:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": sizes}
        print(f"cudagraph_capture_sizes {sizes}", flush=True)
    if args.mode == "peer-hybrid" and importlib.util.find_spec("flashinfer") is None:
        # stock's GDN picks FlashInfer's prefill on Hopper; without it, its Triton prefill (as ours)
        kwargs["additional_config"] = {"gdn_prefill_backend": "triton"}
    llm = LLM(
        model=args.model, dtype=args.dtype, max_model_len=args.prompt_len + args.new_tokens + 16, seed=0,
        max_num_seqs=max(args.batches), max_num_batched_tokens=max(8192, args.prompt_len * 8),
        gpu_memory_utilization=0.5, **kwargs,
    )  # fmt: skip
    results: dict[str, Any] = {}
    for batch in args.batches:
        ps = [TokensPrompt(prompt_token_ids=p) for p in _prompts(batch, args.prompt_len, seed=batch)]

        def run(max_tokens: int, inputs: list[TokensPrompt] = ps) -> float:
            return timed_greedy(llm, inputs, max_tokens)

        run(4)  # warm-up at this batch size
        # The fastest of the repeats: a one-off stall (a JIT compile for a new shape, a host
        # hiccup) in a short run would otherwise swing the difference of two timings.
        prefill = min(run(1) for _ in range(args.repeats))
        total = min(run(args.new_tokens) for _ in range(args.repeats))
        results[str(batch)] = _rates(batch, args.new_tokens, prefill, total, args.prompt_len)
        print("RESULT " + json.dumps(results), flush=True)
    return results


def child_transformers(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import Qwen4ExpForCausalLM

    model = Qwen4ExpForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).cuda().eval()
    results: dict[str, Any] = {}
    with torch.no_grad():
        for batch in args.batches:
            ids = torch.tensor(_prompts(batch, args.prompt_len, seed=batch), device="cuda")

            def run(max_new_tokens: int, ids: torch.Tensor = ids) -> float:
                torch.cuda.synchronize()
                start = time.perf_counter()
                model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
                torch.cuda.synchronize()
                return time.perf_counter() - start

            run(2)
            prefill = min(run(1) for _ in range(args.repeats))
            total = min(run(args.new_tokens) for _ in range(args.repeats))
            results[str(batch)] = _rates(batch, args.new_tokens, prefill, total, args.prompt_len)
            print("RESULT " + json.dumps(results), flush=True)
    return results


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 240_000, (length,), generator=gen).tolist() for _ in range(n)]


def start_child(kind: str, args: argparse.Namespace, extra_env: dict[str, str]) -> tuple[subprocess.Popen[str], Path]:
    """The child, its output streamed to OUT_DIR/child-<kind>-<mode>.log (kept if a limit stops it)."""
    cmd = [sys.executable, __file__, "--child", kind, "--model", args.model, "--dtype", args.dtype,
           "--batches", ",".join(map(str, args.batches)), "--mode", args.mode, "--repeats", str(args.repeats),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--capture-sizes", args.capture_sizes, "unused"]  # fmt: skip
    env = {**os.environ, **extra_env}
    log = args.out / f"child-{kind}-{args.mode if kind == 'vllm' else args.dtype}.log"
    with log.open("w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env), log


def finish_child(child: tuple[subprocess.Popen[str], Path], timeout: int) -> dict[str, Any]:
    """The child's last RESULT line (children print one after each batch size), or the error."""
    proc, log = child
    try:
        proc.wait(timeout=timeout)
        error = None if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        error = f"timed out after {timeout} s"
    output = log.read_text(errors="replace")
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :]) if lines else {}
    if error is not None:
        # the last line that states an error ("ValueError: ...", pydantic's "Value error, ..."), not
        # a line that merely mentions one (pydantic's closing "errors.pydantic.dev" link)
        errors = [line for line in output.splitlines() if re.search(r"(Error|error)[:,]", line)]
        result["error"] = (errors[-1] if errors else error)[:500] + f" ({error}; log: {log.name})"
    return result


def run_child(kind: str, args: argparse.Namespace, extra_env: dict[str, str], timeout: int) -> dict[str, Any]:
    return finish_child(start_child(kind, args, extra_env), timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", default="medium", choices=sorted(CONFIGS))
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument(
        "--modes", default="graphs,compiled,eager",
        help="of eager, graphs, compiled, graphs-v1, graphs-noprefix, peer, peer-hybrid",
    )  # fmt: skip
    parser.add_argument("--work", type=Path, help="where the checkpoints are built (default: OUT_DIR)")
    parser.add_argument("--mode", default="graphs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--stock", action="store_true")
    parser.add_argument(
        "--indexer-budget",
        type=int,
        help="the QSA token budget of every run's checkpoint (default: --config's); with --stock it must be "
        "indexer_compress_ratio times 512, 1024 or 2048, the block top-ks stock's CUDA top-k kernel takes",
    )
    parser.add_argument("--capture-sizes", default="measured", choices=("measured", "vllm"), help=CAPTURE_SIZES_HELP)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--timeout", type=int, default=420)
    parser.add_argument("--child")
    parser.add_argument("--model")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.stock and not args.child:
        from types import SimpleNamespace

        from qwen38_plugin.dispatch import STOCK_CUDA_BLOCK_TOPKS, stock_cuda_topk_refuses
        from qwen38_plugin.tiny.checkpoints import tiny_config_dict

        fields = tiny_config_dict("qwen4_exp_text", CONFIGS[args.config])
        if args.indexer_budget is not None:
            fields["indexer_budget"] = args.indexer_budget
        refused = stock_cuda_topk_refuses(SimpleNamespace(**fields))
        if refused is not None:
            takes = " or ".join(str(fields["indexer_compress_ratio"] * k) for k in STOCK_CUDA_BLOCK_TOPKS)
            parser.error(f"--stock: {refused}: pass --indexer-budget {takes} (every run then uses it)")
    if args.child:
        result = child_vllm(args) if args.child == "vllm" else child_transformers(args)
        print("RESULT " + json.dumps(result), flush=True)
        return

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out
    work.mkdir(parents=True, exist_ok=True)
    model = build_checkpoint(work, args.config, args.dtype, stock_gate=False, indexer_budget=args.indexer_budget)
    args.model = str(model)
    config = json.loads((model / "config.json").read_text())
    elem = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    bandwidth = copy_bandwidth()
    report: dict[str, Any] = {"config": args.config, "indexer_budget": config.get("indexer_budget"),
                              "dtype": args.dtype, "copy_bandwidth_GBps": bandwidth / 1e9,
                              "gpu": torch.cuda.get_device_name(), "capture_sizes": args.capture_sizes,
                              "results": {}}  # fmt: skip
    roof = {b: b / (decode_bytes(config, b, elem) / bandwidth) for b in args.batches}
    report["roofline_decode_tok_s"] = {str(b): r for b, r in roof.items()}
    modes = args.modes.split(",")
    peers: dict[str, tuple[str, Path]] = {}  # mode: (report name, checkpoint)
    for mode, name, hybrid in (("peer", PEER, False), ("peer-hybrid", HYBRID_PEER, True)):
        if mode in modes:
            peer_model = build_peer_checkpoint(work, args.config, args.dtype, hybrid=hybrid)
            peer = json.loads((peer_model / "config.json").read_text())
            count = hybrid_peer_decode_bytes if hybrid else peer_decode_bytes
            report.setdefault("peer_roofline_decode_tok_s", {})[name] = {
                str(b): b / (count(peer, b, elem) / bandwidth) for b in args.batches
            }
            peers[mode] = (name, peer_model)
    # With two GPUs visible, transformers runs on the second one while vLLM runs on the first.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
    gpus = [g for g in visible.split(",") if g]
    hf_env = {"CUDA_VISIBLE_DEVICES": gpus[1]} if len(gpus) >= 2 else {}
    vllm_env = {"CUDA_VISIBLE_DEVICES": gpus[0]} if len(gpus) >= 2 else {}
    report["transformers_gpu"] = "second GPU, concurrently" if hf_env else "same GPU, after vLLM"
    hf = start_child("transformers", args, hf_env) if hf_env and not args.no_transformers else None
    for mode in modes:
        args.mode = mode
        if mode in peers:
            name, peer_model = peers[mode]
            peer_args = argparse.Namespace(**vars(args))
            peer_args.model = str(peer_model)
            # No mode environment: vLLM picks runner, compilation and CUDA graphs as for any user.
            report["results"][name] = run_child("vllm", peer_args, vllm_env, args.timeout)
            _save(args.out, report)
            continue
        env = {"VLLM_USE_V2_MODEL_RUNNER": "0" if mode.endswith("-v1") else "1", **vllm_env}
        if mode.startswith("compiled"):
            env["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
        report["results"][f"ours-{mode}"] = run_child("vllm", args, env, args.timeout)
        _save(args.out, report)
    if not args.no_transformers:
        if hf is None:
            hf = start_child("transformers", args, {})
        report["results"]["transformers"] = finish_child(hf, args.timeout)
        _save(args.out, report)
    if args.stock:
        budget = args.indexer_budget
        stock_model = build_checkpoint(work, args.config, "bfloat16", stock_gate=True, indexer_budget=budget)
        stock_args = argparse.Namespace(**vars(args))
        stock_args.model, stock_args.dtype, stock_args.mode = str(stock_model), "bfloat16", "graphs"
        report["results"]["stock-bf16"] = run_child(
            "vllm", stock_args, {"QWEN38_FORCE_PORTABLE": "0", **vllm_env}, args.timeout
        )
        _save(args.out, report)
    print_table(report, args.batches)


def _save(out: Path, report: dict[str, Any]) -> None:
    (out / "bench_gpu.json").write_text(json.dumps(report, indent=2))


def print_table(report: dict[str, Any], batches: list[int]) -> None:
    roof = report["roofline_decode_tok_s"]
    hf = report["results"].get("transformers", {})
    print(f"{report['gpu']}, {report['config']} {report['dtype']}, copy {report['copy_bandwidth_GBps']:.0f} GB/s")
    print("| run | batch | decode tok/s | step ms | of roofline | vs transformers | prefill tok/s |")
    print("|---|---|---|---|---|---|---|")
    peer_roofs = report.get("peer_roofline_decode_tok_s", {})
    for name, result in report["results"].items():
        if "error" in result:  # what it measured before it stopped, if anything, still prints
            print(f"| {name} | - | failed: {result['error'][:200]} | | | | |")
        for b in batches:
            r = result.get(str(b))
            if r is None:
                continue
            # A peer is a different model: its own roofline, and transformers ran ours, not it.
            own_roof = peer_roofs.get(name, roof)
            vs_hf = "-"
            if str(b) in hf and name not in peer_roofs:
                vs_hf = f"{r['decode_tok_s'] / hf[str(b)]['decode_tok_s']:.1f}x"
            print(
                f"| {name} | {b} | {r['decode_tok_s']:.0f} | {r['step_ms']:.2f} | "
                f"{r['decode_tok_s'] / own_roof[str(b)]:.3f} | {vs_hf} | {r['prefill_tok_s']:.0f} |"
            )
    print("roofline decode tok/s: " + ", ".join(f"b{b}: {roof[str(b)]:.0f}" for b in batches))
    ours = report["results"].get("ours-graphs", {})
    for name, peer_roof in peer_roofs.items():
        print(f"{name} roofline decode tok/s: " + ", ".join(f"b{b}: {peer_roof[str(b)]:.0f}" for b in batches))
        peer = report["results"].get(name, {})
        both = [b for b in batches if str(b) in ours and str(b) in peer]
        if both:
            ratios = (f"b{b}: {ours[str(b)]['decode_tok_s'] / peer[str(b)]['decode_tok_s']:.2f}x" for b in both)
            print(f"decode tok/s ours-graphs / {name}: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
