"""Issue 16: Qwen3.8 Flash-Next's real per-layer geometry served at TP=1, 2 and 4 through stock vLLM.

    python benchmarks/qwen38_plugin/bench_tp.py OUT_DIR [--tps 1,2,4] [--layers 4] [--batches 1,8,64]
        [--mtp 3] [--work DIR]
    python benchmarks/qwen38_plugin/bench_tp.py OUT_DIR --dry-run [--tps 1,2,4] [--geometry flash-next]  # CPU

The checkpoint: random fp16 weights with Flash-Next's geometry as `footprint.FLASH_NEXT` infers it
(hidden 2560, 24 Q / 2 KV heads of 256, GDN 16 K / 48 V heads of 128, 512 experts of width 512 with
10 active, a shared expert, 4 hyper-connection streams, the real 248,320-token vocabulary, an MTP
head) and ``--layers`` layers in Flash-Next's pattern (three GDN layers, then a QSA layer), PLE on
layer 1. The PLE n-gram tables are smaller than Flash-Next's (``--ngram-base``; Flash-Next's
20,000,000 makes about 90 GiB, more than a lent machine's disk): they shard and sit in host memory
the same way. Built once under ``--work``.

For each tensor-parallel size of ``--tps`` that the machine's GPUs allow (others are listed as not
run), one vLLM child (fp16, vLLM's defaults: V2 runner, CUDA graphs) serves:

* 8 prompts of 1 to 300 tokens together, 32 greedy tokens each, with the top-2 logprobs; their
  tokens are compared with TP=1's (identical, or the first difference with TP=1's margin there:
  a different all-reduce order moves fp16 logits, so a flip at a near tie is not a bug);
* decode tokens/s at each of ``--batches`` (128-token random prompts, 64 new tokens, the fastest of
  two runs, bench_gpu's method), from which the step time per batch follows.

With ``--mtp K`` each TP size runs again with MTP (K drafts): tokens equal to that TP size without
speculation, and the acceptance counters. ``--dcp 2`` runs each TP size >= 2 again with
``decode_context_parallel_size=2`` (the QSA layers' K/V positions split over the ranks that share a
KV head): tokens against TP=1's and decode speed where vLLM allows it (more TP ranks than KV heads:
TP=4 for Flash-Next's 2), else how startup refuses it; with ``--mtp K`` too, once more with both
(MTP beside DCP: on CPU; refused at startup on CUDA). On a GPU, each decode speed is also set
against bench_gpu's weight-read roofline for this geometry (the copy bandwidth measured in the same
run; TP=n against n times TP=1's): issue 10's measure at a real model's widths, where the medium
config's steps are mostly fixed costs. Last,
the all-reduce traffic a decode step needs at each batch size (two all-reduces of ``hidden_size``
per token and layer, fp16) and its time on a V100 PCIe ring (the reference deployment's 4 x V100:
``--v100-link-gbs`` GB/s per direction, ring all-reduce moves 2 (n - 1) / n of the bytes), beside
the measured step times. Results: OUT_DIR/bench_tp.json.

``--dry-run`` proves the script on CPU: the geometry scaled down (hidden 256, 16 experts; the real
head counts and vocabulary), fp32, TP 1 and 2 unless ``--tps`` says otherwise (each rank a process
bound to a core, ranks beyond the core count sharing them), batches 1 and 2, MTP with 2 drafts, DCP
2; its tokens are a real comparison, its speeds are not measurements. ``--geometry flash-next`` runs
Flash-Next's own per-layer geometry there instead, with 32 experts (host memory) and the n-gram base
of ``--ngram-base``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "qwen38_plugin"))

from bench_gpu import CAPTURE_SIZES_HELP, capture_sizes, finish_child, timed_greedy  # noqa: E402  (shared with bench_gpu)
from footprint import FLASH_NEXT  # noqa: E402  (Flash-Next's inferred geometry)

PROMPT_LENS = (1, 3, 29, 70, 45, 300, 259, 320)
STEPS = 32


# On CPU, Flash-Next's own per-layer geometry with fewer experts (the one cut, for host memory: 512 experts
# are 2 GB a layer in fp32); the 10 active experts, their width and everything else as Flash-Next.
CPU_EXPERTS = 32


def geometry(layers: int, ngram_base: int, dry_run: bool, shape: str = "scaled") -> dict[str, Any]:
    """Config overrides: Flash-Next's per-layer geometry, ``layers`` layers (3 GDN then 1 QSA, repeated)."""
    pattern = ["linear_attention"] * 3 + ["indexed_attention"]
    config = {**FLASH_NEXT, "num_hidden_layers": layers, "layer_types": (pattern * layers)[:layers]}
    config.update(ngram_vocab_size_base=ngram_base, mtp_num_hidden_layers=1)
    if dry_run and shape == "flash-next":
        config.update(num_experts=CPU_EXPERTS)
    elif dry_run:  # same shape of model, a CPU's size
        config.update(hidden_size=256, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32,
                      num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                      shared_expert_intermediate_size=64, hc_lowrank=32, ple_embed_dim=256,
                      indexer_head_dim=32, ngram_vocab_size_base=2_000)  # fmt: skip
    if "indexed_attention" not in config["layer_types"]:
        raise SystemExit(f"--layers {layers}: use at least 4, so that a QSA layer (the MTP head's kind) is among them")
    return config


def build(
    work: Path, layers: int, ngram_base: int, dtype: str, dry_run: bool, shape: str = "scaled", device: str = "cpu"
) -> Path:
    """The checkpoint (built once per work directory). On a GPU its random weights are drawn there:
    Flash-Next's widths took 188 s to draw on the H200 host's CPU (2026-12-04)."""
    import torch

    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint

    config = geometry(layers, ngram_base, dry_run, shape)
    tag = ("-dry" if shape == "scaled" else f"-cpu{CPU_EXPERTS}experts") if dry_run else ""
    path = work / f"flash-next-{layers}l-ngram{config['ngram_vocab_size_base']}-{dtype}{tag}"
    if not path.exists():
        started = time.perf_counter()
        build_tiny_checkpoint(path, "qwen4_exp_text", overrides=config, dtype=dtype, device=device)
        print(f"built {path.name} on {device} in {time.perf_counter() - started:.0f} s", flush=True)
        if device != "cpu":
            torch.cuda.empty_cache()  # the vLLM children size their memory from what this process leaves free
    return path


def prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 240_000, (n,), generator=gen).tolist() for n in PROMPT_LENS]


# ---------------------------------------------------------------------------------------------
# the vLLM child
# ---------------------------------------------------------------------------------------------


def child(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "seed": 0, "skip_tokenizer_init": True,
                              "tensor_parallel_size": args.tp, "max_model_len": 512,
                              "max_num_seqs": max([*args.batches, len(PROMPT_LENS)])}  # fmt: skip
    if args.cpu:
        kwargs["enable_prefix_caching"] = False  # vLLM's CPU runner, with speculation
    else:
        kwargs["gpu_memory_utilization"] = 0.85
        sizes = capture_sizes(args.capture_sizes, [*args.batches, len(PROMPT_LENS)], 1 + args.mtp)
        if sizes is not None:
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": sizes}
            print(f"cudagraph_capture_sizes {sizes}", flush=True)
    if args.mtp:
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.mtp}
    if args.dcp:
        kwargs["decode_context_parallel_size"] = args.dcp
    llm = LLM(**kwargs, disable_log_stats=False)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], params, use_tqdm=False)
    result: dict[str, Any] = {"tokens": [], "margins": []}
    for output in outputs:
        completion = output.outputs[0]
        result["tokens"].append(list(completion.token_ids))
        margins = []
        for step in completion.logprobs or []:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else None)
        result["margins"].append(margins)
    print("RESULT " + json.dumps(result), flush=True)
    result["decode_tok_s"] = {}
    import torch

    gen = torch.Generator().manual_seed(1)
    for batch in args.batches:
        inputs = [TokensPrompt(prompt_token_ids=torch.randint(0, 240_000, (128,), generator=gen).tolist())
                  for _ in range(batch)]  # fmt: skip
        timed_greedy(llm, inputs, 4)  # warm-up at this batch size
        prefill = min(timed_greedy(llm, inputs, 1) for _ in range(2))
        total = min(timed_greedy(llm, inputs, 64) for _ in range(2))
        result["decode_tok_s"][str(batch)] = batch * 63 / max(total - prefill, 1e-9)
        print("RESULT " + json.dumps(result), flush=True)
    if args.mtp:
        from vllm.v1.metrics.reader import Counter

        result["spec_decode"] = {m.name.removeprefix("vllm:"): m.value for m in llm.get_metrics()
                                 if m.name.startswith("vllm:spec_decode_num") and isinstance(m, Counter)}  # fmt: skip
    return result


def run_child(args: argparse.Namespace, model: Path, tp: int, tag: str, mtp: int = 0, dcp: int = 0) -> dict[str, Any]:
    cmd = [sys.executable, __file__, str(args.out), "--child", "--model", str(model), "--dtype", args.dtype,
           "--tp-one", str(tp), "--batches", ",".join(map(str, args.batches)), "--mtp", str(mtp),
           "--dcp", str(dcp), "--capture-sizes", args.capture_sizes]  # fmt: skip
    env = dict(os.environ)
    if args.cpu:
        cmd.append("--cpu")
        cores = os.cpu_count() or 2
        per = max(1, cores // tp)
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="|".join(
            f"{r * per}-{r * per + per - 1}" if per > 1 else str(r % cores) for r in range(tp)))  # fmt: skip
    log = args.out / f"child-{tag}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
    result = finish_child((proc, log), args.timeout)
    if "error" in result:
        # A startup refusal is the answer for DCP: keep its root cause (a worker's exception, which the
        # engine's own "initialization failed" line hides) and the log's end.
        text = log.read_text(errors="replace")
        result["root_cause"] = root_cause(text)
        result["log_tail"] = text[-1500:]
    return result


def root_cause(log: str) -> str:
    """The first exception line of a failed start (``SomeError: message``), the engine's wrapper skipped."""
    lines = log.splitlines()
    for line in lines:  # a rank killed from outside (the kernel's out-of-memory killer, say) raises nothing
        if match := re.search(r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+)\)", line):
            return f"worker {match.group(1)} died (exit code {match.group(2)}; -9: killed, as for lack of memory)"
    for i, line in enumerate(lines):
        if " WARNING " in line:  # vLLM logs tracebacks it recovers from as warnings
            continue
        match = re.search(r"\b(\w+(?:Error|Exception)): (.+)$", line)
        if match and "Engine core initialization failed" not in match.group(2):
            message = match.group(2).strip()
            if "validation error" in message and i + 1 < len(lines):  # pydantic: the reason is the next line
                message += " -- " + lines[i + 1].strip().split(" [type=")[0]
            return f"{match.group(1)}: {message}"
    return ""


# ---------------------------------------------------------------------------------------------
# comparisons and the all-reduce estimate
# ---------------------------------------------------------------------------------------------


def compare(tokens: list[list[int]], reference: dict[str, Any]) -> dict[str, Any]:
    """Identical prompts, and per prompt the first differing step with the reference's margin there."""
    firsts, margins = [], []
    for ours, theirs, margin in zip(tokens, reference["tokens"], reference["margins"], strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        firsts.append(first)
        margins.append(None if first is None else margin[first])
    return {"identical_prompts": sum(f is None for f in firsts), "prompts": len(firsts),
            "first_difference": firsts, "reference_margin_there": margins}  # fmt: skip


def allreduce_estimate(config: dict[str, Any], batch: int, ranks: int, link_gbs: float) -> dict[str, float]:
    """A decode step's all-reduce bytes (two per layer: the row-parallel output of the attention or
    GDN mixer and of the MoE, each ``hidden_size`` wide; the embedding's and the lm_head's gathers
    left out) and their time on a ``ranks``-GPU ring."""
    per_allreduce = batch * config["hidden_size"] * 2  # fp16
    count = 2 * config["num_hidden_layers"]
    moved = per_allreduce * count * 2 * (ranks - 1) / ranks
    return {"bytes_per_step": per_allreduce * count, "v100_ring_ms": moved / (link_gbs * 1e9) * 1e3}


def finished_runs(path: Path, model: str, batches: list[int]) -> dict[str, dict[str, Any]]:
    """The runs of an earlier bench_tp.json that measured every batch of this checkpoint (by TP, then
    name); a run that failed or was cut is measured again."""
    if not path.exists():
        return {}
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    if report.get("model") != model:
        return {}
    wanted = {str(b) for b in batches}
    return {
        tp: {name: run for name, run in entry.items() if "tokens" in run and wanted <= set(run.get("decode_tok_s", {}))}
        for tp, entry in report.get("runs", {}).items()
    }


def summary(report: dict[str, Any]) -> str:
    """bench_tp.json as a table: each run's tokens against its reference, speeds, drafts, startup."""
    lines = [f"# device {report['device']}, model {report['model']}, dtype {report['dtype']}; "
             f"not run: {'; '.join(report['not_run']) or 'none'}",
             "| TP | run | prompts identical | first differing step per prompt (reference's margin) "
             "| decode tok/s by batch | MTP draft tokens / accepted | start, or why not |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for tp, entry in report["runs"].items():
        for name, run in entry.items():
            versus = run.get("vs_tp1") or run.get("vs_plain")
            reference = "TP=1" if "vs_tp1" in run else f"TP={tp} without MTP"
            same = f"{versus['identical_prompts']}/{versus['prompts']} (vs {reference})" if versus else "-"
            firsts = "-"
            if versus:  # the step, and the reference's top-2 logprob margin there (a near tie when small)
                pairs = zip(versus["first_difference"], versus["reference_margin_there"], strict=True)
                firsts = ", ".join("-" if f is None else f"{f} ({m:.3g})" for f, m in pairs)
            roof = report.get("roofline_decode_tok_s", {})
            speeds = ", ".join(
                f"b{b}: {x:.1f}" + (f" ({100 * x / (int(tp) * roof[b]):.1f} % of roofline)" if b in roof else "")
                for b, x in run.get("decode_tok_s", {}).items()
            ) or "-"  # fmt: skip
            spec = run.get("spec_decode")
            drafts = (
                f"{spec['spec_decode_num_draft_tokens']:.0f} / {spec['spec_decode_num_accepted_tokens']:.0f}"
                if spec
                else "-"
            )
            started = run.get("root_cause") or run.get("error", "ok")
            lines.append(f"| {tp} | {name} | {same} | {firsts} | {speeds} | {drafts} | {started} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tps", default=None, help="tensor-parallel sizes (default 1,2,4; --dry-run: 1,2)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ngram-base", type=int, default=200_000)
    parser.add_argument("--dtype", default=None, help="float16 (--dry-run: float32)")
    parser.add_argument("--batches", default=None, help="decode batches (default 1,8,64; --dry-run: 1,2; '' none)")
    parser.add_argument("--mtp", type=int, default=0, help="MTP drafts (0: no speculative runs)")
    parser.add_argument("--dcp", type=int, default=0, help="decode_context_parallel_size to try at TP >= 2")
    parser.add_argument("--v100-link-gbs", type=float, default=10.0, help="V100 PCIe ring bandwidth, GB/s")
    parser.add_argument("--work", type=Path, default=Path("/tmp/qwen38_bench_tp"))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per vLLM child")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--build-device", choices=("cpu", "cuda"), help="where the random weights are drawn "
                        "(default: cuda where there is one)")  # fmt: skip
    parser.add_argument("--capture-sizes", default="measured", choices=("measured", "vllm"), help=CAPTURE_SIZES_HELP)
    parser.add_argument("--geometry", choices=("scaled", "flash-next"), default="scaled",
                        help=f"--dry-run's model: scaled, or Flash-Next's own with {CPU_EXPERTS} experts")  # fmt: skip
    parser.add_argument("--summary", action="store_true", help="print OUT_DIR/bench_tp.json as a table, run nothing")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--tp-one", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # unset options take the GPU run's defaults, or --dry-run's (a child is always given them)
    dry = args.dry_run
    args.tps = args.tps if args.tps is not None else ("1,2" if dry else "1,2,4")
    batches = args.batches if args.batches is not None else ("1,2" if dry else "1,8,64")
    args.batches = [int(b) for b in batches.split(",") if b]
    args.dtype = args.dtype or ("float32" if dry else "float16")
    if args.summary:
        print(summary(json.loads((args.out / "bench_tp.json").read_text())))
        return
    if args.child:
        args.tp = args.tp_one
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    import torch

    args.cpu = not torch.cuda.is_available()
    if args.dry_run:
        args.mtp, args.dcp = args.mtp or 2, 2
    elif args.cpu:
        parser.error("no CUDA device here: pass --dry-run to prove the script on CPU")
    # On CPU the ranks are processes bound to the cores in turn (more ranks than cores share them).
    available = max(int(t) for t in args.tps.split(",")) if args.cpu else torch.cuda.device_count()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    build_device = args.build_device or ("cpu" if args.cpu else "cuda")
    model = build(args.work, args.layers, args.ngram_base, args.dtype, args.dry_run, args.geometry, build_device)
    config = json.loads((model / "config.json").read_text())
    report: dict[str, Any] = {"device": "cpu" if args.cpu else torch.cuda.get_device_name(), "gpus": available,
                              "model": model.name, "dtype": args.dtype, "runs": {}, "not_run": []}  # fmt: skip
    if not args.cpu:
        # Issue 10's measure at this geometry: bench_gpu's weight-read roofline (the bytes a decode step
        # reads over the copy bandwidth measured here), per GPU; at TP=n each rank reads about 1/n of it
        # in parallel, so TP=n is set against n times the TP=1 roofline (optimistic: some weights are
        # replicated on every rank).
        from bench_gpu import copy_bandwidth, decode_bytes

        bandwidth = copy_bandwidth()
        elem = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
        report["copy_bandwidth_GBps"] = bandwidth / 1e9
        report["roofline_decode_tok_s"] = {str(b): b * bandwidth / decode_bytes(config, b, elem) for b in args.batches}

    def save() -> None:
        # written after every child, so a device call cut by its time limit keeps what finished
        (args.out / "bench_tp.json").write_text(json.dumps(report, indent=2))

    # A run measured earlier into the same OUT for the same checkpoint and batches is kept, not run again:
    # on a warm machine the next call finishes what the last one's limit cut (2026-12-04: building the 16 GB
    # checkpoint took 188 s, TP=1 about 200 s, and the call ended inside the MTP run).
    earlier = finished_runs(args.out / "bench_tp.json", model.name, args.batches)
    reference = None
    for tp in (int(t) for t in args.tps.split(",")):
        if tp > available:
            report["not_run"].append(f"TP={tp}: {available} GPU(s) here")
            continue
        entry: dict[str, Any] = {}
        report["runs"][str(tp)] = entry

        def measured(name: str, tag: str, tp: int = tp, entry: dict[str, Any] = entry, **kwargs: int) -> dict[str, Any]:
            run = earlier.get(str(tp), {}).get(name)
            if run is None:
                run = run_child(args, model, tp, tag, **kwargs)
            else:
                print(f"TP={tp} {name}: kept from the earlier run into {args.out}", flush=True)
            entry[name] = run
            save()
            return run

        plain = measured("plain", f"tp{tp}")
        if "tokens" in plain and reference is None:
            reference = plain
        if "tokens" in plain and reference is not None:
            plain["vs_tp1"] = compare(plain["tokens"], reference)
        if args.mtp and "tokens" in plain:
            spec = measured(f"mtp{args.mtp}", f"tp{tp}-mtp{args.mtp}", mtp=args.mtp)
            if "tokens" in spec:
                spec["vs_plain"] = compare(spec["tokens"], plain)
        if args.dcp and tp >= args.dcp:
            dcp = measured(f"dcp{args.dcp}", f"tp{tp}-dcp{args.dcp}", dcp=args.dcp)
            if "tokens" in dcp and reference is not None:
                dcp["vs_tp1"] = compare(dcp["tokens"], reference)
            if args.mtp and "tokens" in dcp:  # the reference deployment's shape with its default speculation
                both = measured(f"mtp{args.mtp}-dcp{args.dcp}", f"tp{tp}-mtp{args.mtp}-dcp{args.dcp}", mtp=args.mtp,
                                dcp=args.dcp)  # fmt: skip
                if "tokens" in both and reference is not None:
                    both["vs_tp1"] = compare(both["tokens"], reference)
        save()
        brief = {k: (v.get("vs_tp1"), v.get("decode_tok_s"), v.get("error")) for k, v in entry.items() if k == "plain"}
        print(f"TP={tp}: {json.dumps(brief)}", flush=True)
    report["allreduce"] = {
        str(b): {str(n): allreduce_estimate(config, b, n, args.v100_link_gbs) for n in (2, 4)} for b in args.batches
    }
    save()
    print(json.dumps(report["allreduce"], indent=1))
    print(summary(report))


if __name__ == "__main__":
    main()
