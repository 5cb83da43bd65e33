"""Every GPU check of the portable Qwen4Exp, for a lent GPU machine with the kit of
../shared/docs/h200-vllm.md installed (stock vLLM 0.32 and this checkout's plugins):

    python3 benchmarks/qwen38_plugin/gpu_session.py OUT [--only ops,exact,tp2,bench,mm,spec]
        [--runners v2,v1] [--dtypes float16,bfloat16] [--modes graphs,compiled,eager]
        [--work /tmp/qwen38_gpu_session] [--device cuda]

1. ``ops``: the CUDA tests of the kernels (QSA paged ops, varlen GDN / PLE, fla's GDN), natively
   and in CUDA graphs.
2. ``exact``: stock vLLM serving the tiny checkpoint with our model, CUDA graphs on in both of
   vLLM's ways (``graphs``: its default for this architecture, breakable CUDA graphs without
   torch.compile; ``compiled``: torch.compile, full graphs for decode steps and piecewise graphs
   around our ops otherwise; ``eager``), prompts of 1 to 320 tokens, first each alone and then
   all together (concurrent mixed lengths, chunked prefill at 64 tokens a step, prefix-cache hits
   on the shared prefixes), in the GPU model runners named by ``--runners`` (V2, vLLM's default
   on GPUs, and V1, the one the CPU runs), against transformers in the same dtype on the same GPU:
   greedy tokens identical over 32 steps until the first step where transformers' own top two
   logprobs nearly tie (``NEAR_TIE``; counts and margins are recorded). float32 is refused on
   CUDA (vLLM's GDN prefill kernel has no float32); the CPU tests prove float32 bit-exactness.
3. ``tp2`` (two GPUs): 2. at ``tensor_parallel_size=2`` in the first of ``--dtypes``, by the same
   rule, and whether its tokens equal TP=1's.
4. ``bench``: benchmarks/qwen38_plugin/bench_gpu.py (medium config, fp16, batches 1 / 8 / 64 / 256,
   eager and CUDA graphs, transformers, stock's bf16 model if it starts).
5. ``mm`` (only when named in ``--only``): stock vLLM serving the tiny random
   ``Qwen4ExpForConditionalGeneration`` of tests/qwen38_plugin/mm_checkpoint.py in float16 (the portable
   multimodal model; vLLM's default CUDA graphs) through tests/qwen38_plugin/qwen38_mm_engine.py: images
   (one of 1 megapixel, split over prefill steps of 256 tokens) and short videos, the prompts all
   together, then each alone (prefix-cache hits on the first run's blocks), against transformers'
   ``Qwen4ExpForConditionalGeneration`` in the same dtype on the same GPU by the rule of ``exact``
   (prompt token ids equal; greedy tokens equal over 16 steps until transformers' own top two nearly
   tie); then bench_vision.py (Flash-Next's 27-block tower, fp16, one 1-megapixel image) and
   bench_mm_ttft.py (time to first token with and without a 1-megapixel image through `vllm serve`).
   Writes ``mm.json``. ``--device cpu`` runs the same step on the CPU as a dry run: float32 (tokens
   then identical), smaller media, a one-block tower.
6. ``spec`` (only when named in ``--only``): speculative decoding on the portable model in float16
   with vLLM's default CUDA graphs: the tiny checkpoint with its MTP head and the two-token lm_head
   of tests/qwen38_plugin/test_qwen38_spec_verify_engine.py (drafts accepted often, so verify
   steps keep several tokens and the GDN / PLE / QSA states roll back), the prompts of ``exact``
   all together, served without speculation, with MTP (``num_speculative_tokens`` 3), MTP with
   dflash2's concurrency ladder, and DFlash (a tiny drafter through a ``dflash2-view``, 4 drafts);
   each against transformers by the rule of ``exact`` and against the run without speculation
   (equal tokens), with vLLM's spec-decode counters. Writes ``spec.json``. ``--spec-runs`` also
   names the variants that isolate DFlash's failure on the H200 (`SPEC_RUNS`), and MTP and DFlash at
   ``tensor_parallel_size=2`` (``mtp3-tp2``, ``dflash3-tp2``: two GPUs, or two CPU ranks).

Each engine runs in a child process with a time limit, so one failure does not stop the others;
results are written to OUT as they come (``exact.json``, ``summary.json``, one log per child), so
a command stopped at its limit still returns them. Checkpoints go under ``--work``, reused by
later calls on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEPS = 32
EOS = 248046


def prompts(seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randint(0, 248_000, (n,), generator=gen).tolist() for n in (1, 3, 29, 70, 45, 300)]
    ps[3][33] = EOS
    # shared prefixes: the last two continue the 300-token prompt (prefix-cache hits)
    ps += [[*ps[5][:256], 11, 12, 13], ps[5] + [7] * 20]
    return ps


def run(
    name: str, cmd: list[str], out: Path, timeout: int, env: dict[str, str] | None = None, terminate: bool = False
) -> dict[str, Any]:
    """Run a child, its output streamed into OUT/<name>.log (kept when a limit stops the child or us).
    At the limit the child is killed; with ``terminate`` it first gets SIGTERM and 30 s to clean up
    (a child that started a server in its own session stops it)."""
    start = time.time()
    path = out / f"{name}.log"
    with path.open("w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if terminate:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            else:
                proc.kill()
            proc.wait()
            status = 124
            log_file.write(f"\ntimed out after {timeout} s\n")
    log = path.read_text(errors="replace")
    return {"status": status, "seconds": round(time.time() - start, 1), "tail": log[-1500:]}


NEAR_TIE = {"float16": 2**-8, "bfloat16": 2**-5}  # as tests/qwen38_plugin/qwen38_reference.py
ENGINE = {"max_num_batched_tokens": 64, "max_num_seqs": 16, "solo": True, "disable_log_stats": False}


def engine_run(
    model: Path, dtype: str, out: Path, tag: str, env: dict[str, str] | None = None, **extra: Any
) -> dict[str, Any] | None:
    """The engine's tokens: {"tokens" (together), "solo", "prefix_cache_hits", ...} or None."""
    cmd = [sys.executable, str(ROOT / "tests/qwen38_plugin/qwen38_engine_greedy.py"), str(model), dtype, str(STEPS),
           json.dumps(prompts(0)), json.dumps({**ENGINE, **extra})]  # fmt: skip
    result = run(f"engine-{tag}", cmd, out, 420, env)
    lines = [line for line in (out / f"engine-{tag}.log").read_text().splitlines() if line.startswith('{"tokens"')]
    if not lines:
        print(f"engine {tag} failed: {result['tail'][-800:]}", flush=True)
        return None
    served: dict[str, Any] = json.loads(lines[-1])
    served["seconds"] = result["seconds"]
    return served


def reference(model: Path, dtype: str, device: str = "cuda") -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens and, per step, the margin between its top two logprobs."""
    import torch
    from transformers import Qwen4ExpForCausalLM

    hf = Qwen4ExpForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    tokens, margins = [], []
    with torch.no_grad():
        for p in prompts(0):
            ids = torch.tensor([p], device=device)
            gen = hf.generate(ids, max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)  # fmt: skip
            tokens.append(gen.sequences[0, len(p) :].tolist())
            top = [torch.log_softmax(s[0].float(), -1).topk(2).values for s in gen.scores]
            margins.append([float(t[0] - t[1]) for t in top])
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    return tokens, margins


def compare(served: list[list[int]], ref: list[list[int]], margins: list[list[float]], dtype: str) -> dict[str, Any]:
    """Equal tokens per prompt; fp32 must be identical, other dtypes until a near tie of the reference."""
    first = [next((i for i, (a, b) in enumerate(zip(s, r, strict=True)) if a != b), None)
             for s, r in zip(served, ref, strict=True)]  # fmt: skip
    at_difference = [m[i] if i is not None else None for m, i in zip(margins, first, strict=True)]
    if dtype == "float32":
        ok = all(i is None for i in first)
    else:
        ok = all(m is None or m < NEAR_TIE[dtype] for m in at_difference)
    return {"ok": ok, "identical_prompts": sum(i is None for i in first), "prompts": len(first),
            "first_difference": first, "reference_margin_at_first_difference": at_difference}  # fmt: skip


def checkpoint(work: Path, dtype: str) -> Path:
    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint

    model = work / f"tiny-{dtype}"
    if not model.exists():
        build_tiny_checkpoint(model, "qwen4_exp_text", dtype=dtype)
    return model


def exact(out: Path, work: Path, runners: list[str], dtypes: list[str], modes: list[str]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for dtype in dtypes:
        model = checkpoint(work, dtype)
        ref, margins = reference(model, dtype)
        (work / f"reference-{dtype}.json").write_text(json.dumps({"tokens": ref, "margins": margins}))
        for runner in runners:
            for mode in modes:
                key = f"{dtype}-{runner}-{mode}"
                env = {**RUNNER_ENV[runner], **MODE_ENV[mode]}
                served = engine_run(model, dtype, out, key, env, enforce_eager=mode == "eager")
                if served is None:
                    report[key] = {"ok": False, "error": "engine failed: see engine-" + key + ".log"}
                else:
                    report[key] = {
                        "together": compare(served["tokens"], ref, margins, dtype),
                        "solo": compare(served["solo"], ref, margins, dtype),
                        "prefix_cache_hits": served.get("prefix_cache_hits"),
                        "preemptions": served.get("preemptions"), "seconds": served["seconds"],
                    }  # fmt: skip
                    report[key]["ok"] = report[key]["together"]["ok"] and report[key]["solo"]["ok"]
                    (work / f"tokens-{key}.json").write_text(json.dumps(served["tokens"]))
                (out / "exact.json").write_text(json.dumps(report, indent=2))
                print(key, json.dumps(report[key]), flush=True)
    return report


def tp2(out: Path, work: Path, runners: list[str], dtype: str) -> dict[str, Any]:
    """``tensor_parallel_size=2`` against transformers (the rule of `compare`) and TP=1's tokens."""
    report: dict[str, Any] = {}
    model = checkpoint(work, dtype)
    ref_file = work / f"reference-{dtype}.json"
    if not ref_file.exists():
        ref, margins = reference(model, dtype)
        ref_file.write_text(json.dumps({"tokens": ref, "margins": margins}))
    reference_run = json.loads(ref_file.read_text())
    ref, margins = reference_run["tokens"], reference_run["margins"]
    for runner in runners:
        key = f"{dtype}-{runner}-graphs-tp2"
        served = engine_run(model, dtype, out, key, RUNNER_ENV[runner], tensor_parallel_size=2)
        tp1_file = work / f"tokens-{dtype}-{runner}-graphs.json"
        tp1 = json.loads(tp1_file.read_text()) if tp1_file.exists() else None
        if served is None:
            report[key] = {"ok": False, "error": f"engine failed: see engine-{key}.log"}
        else:
            report[key] = {"together": compare(served["tokens"], ref, margins, dtype),
                           "solo": compare(served["solo"], ref, margins, dtype),
                           "equals_tp1": served["tokens"] == tp1 if tp1 is not None else "TP=1 not run",
                           "seconds": served["seconds"]}  # fmt: skip
            report[key]["ok"] = report[key]["together"]["ok"] and report[key]["solo"]["ok"]
        (out / "tp2.json").write_text(json.dumps(report, indent=2))
        print(key, json.dumps(report[key]), flush=True)
    return report


def mm_requests(cuda: bool, steps: int) -> list[dict[str, Any]]:
    """The mm step's requests (tests/qwen38_plugin/mm_inputs.py's form): images, videos, text only."""
    from tests.qwen38_plugin.mm_inputs import IMAGE, VIDEO

    big = [1024, 1024, 11] if cuda else [320, 256, 11]  # 1 MP: 1,024 image tokens
    return [
        {"text": f"Look {IMAGE} and {VIDEO} ok", "images": [[300, 200, 1]], "video": [4, 96, 128, 2]},
        {"text": f"Compare {IMAGE} with {IMAGE} please", "images": [[256, 320, 4], big], "video": None},
        {"text": f"What happens in {VIDEO}?", "images": [], "video": [8, 128, 160, 3]},
        {"text": "Only words here, no pictures at all, and a few more of them", "images": [], "video": None},
    ]  # fmt: skip


def mm_reference(model: Path, requests: list[dict[str, Any]], dtype: str, device: str) -> list[dict[str, Any]]:
    """transformers' `Qwen4ExpForConditionalGeneration` on each request alone (no cache, greedy)."""
    import torch
    from transformers import AutoProcessor

    from tests.qwen38_plugin.mm_inputs import hf_inputs, hf_run, load_hf_model

    processor = AutoProcessor.from_pretrained(model)
    hf = load_hf_model(model, getattr(torch, dtype), device)
    results = [hf_run(hf, hf_inputs(processor, r), r["max_tokens"]) for r in requests]
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


def mm(out: Path, work: Path, device: str) -> dict[str, Any]:
    """Step 5 (see the module's docstring); ``device`` cpu: the dry run."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the repository's tests package
    from tests.qwen38_plugin.mm_checkpoint import mm_model_checkpoint

    cuda = device == "cuda"
    dtype, steps = ("float16", 16) if cuda else ("float32", 8)
    requests = [{**r, "max_tokens": steps} for r in mm_requests(cuda, steps)]
    report: dict[str, Any] = {"device": device, "dtype": dtype, "steps": steps, "requests": requests}

    def save() -> None:
        (out / "mm.json").write_text(json.dumps(report, indent=2, default=str))

    model = mm_model_checkpoint()
    report["checkpoint"] = str(model)
    # vLLM: all requests together (chunked prefill: the 1-MP image spans several steps), then each
    # alone on the same engine (prefix-cache hits on the first phase's blocks)
    extra = {"dtype": dtype, "max_model_len": 2048, "max_num_batched_tokens": 256 if cuda else 64, "max_num_seqs": 4,
             "enable_prefix_caching": True, "disable_log_stats": False}  # fmt: skip
    env = {} if cuda else {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    phases = [requests] + [[r] for r in requests]
    cmd = [sys.executable, str(ROOT / "tests/qwen38_plugin/qwen38_mm_engine.py"), str(model), json.dumps(phases),
           json.dumps(extra)]  # fmt: skip
    engine = run("mm-engine", cmd, out, 300, env)
    lines = [line for line in (out / "mm-engine.log").read_text().splitlines() if line.startswith('{"phases"')]
    served = json.loads(lines[-1])["phases"] if lines else None
    report["engine"] = {"status": engine["status"], "seconds": engine["seconds"]}
    if served is None:
        report["engine"]["error"] = "engine failed: see mm-engine.log"
        print(f"mm engine failed: {engine['tail'][-800:]}", flush=True)
    save()
    try:
        ref = mm_reference(model, requests, dtype, device)
    except Exception as error:  # recorded; the benchmarks below still run
        report["reference_error"] = repr(error)
        ref = None
    if served is not None and ref is not None:
        together = served[0]["requests"]
        solo = [phase["requests"][0] for phase in served[1:]]
        ref_tokens, margins = [r["tokens"] for r in ref], [r["margins"] for r in ref]
        report["prompt_ids_equal"] = [
            s["prompt_token_ids"] == r["prompt_token_ids"] for s, r in zip(together, ref, strict=True)
        ]
        report["prompt_tokens"] = [len(r["prompt_token_ids"]) for r in ref]
        report["together"] = compare([s["tokens"] for s in together], ref_tokens, margins, dtype)
        report["solo"] = compare([s["tokens"] for s in solo], ref_tokens, margins, dtype)
        report["prefix_cache_hits"] = [phase["prefix_cache_hits"] for phase in served]
        report["ok"] = all(report["prompt_ids_equal"]) and report["together"]["ok"] and report["solo"]["ok"]
    else:
        report["ok"] = False
    save()
    print("mm exactness:", json.dumps({k: report.get(k) for k in ("ok", "prompt_ids_equal", "together", "solo",
          "prefix_cache_hits", "reference_error")}), flush=True)  # fmt: skip
    # the vision tower: Flash-Next's geometry (27 blocks) and a 1-MP image on CUDA; one block, 256 x 256 on CPU
    sizes = ["--depth", "27", "--pixels", "1048576", "--repeats", "3"] if cuda else ["--depth", "1", "--pixels",
             "65536", "--repeats", "1"]  # fmt: skip
    vision = run("mm-bench-vision", [sys.executable, str(ROOT / "benchmarks/qwen38_plugin/bench_vision.py"),
                 "--dtype", dtype, *sizes], out, 200 if cuda else 300)  # fmt: skip
    table = [line for line in vision["tail"].splitlines() if line.startswith(("|", "merged", "NVIDIA", "CPU"))]
    report["bench_vision"] = {"status": vision["status"], "seconds": vision["seconds"], "output": table}
    save()
    print("\n".join(table) if vision["status"] == 0 else f"bench_vision failed: {vision['tail'][-800:]}", flush=True)
    ttft_out = out / "mm-ttft"
    cmd = [sys.executable, str(ROOT / "benchmarks/qwen38_plugin/bench_mm_ttft.py"), "--device-dtype", dtype,
           "--repeats", "5" if cuda else "2", "--out", str(ttft_out), "--startup-timeout", "240"]  # fmt: skip
    ttft = run("mm-ttft", cmd, out, 300, terminate=True)
    result_file = ttft_out / "bench_mm_ttft.json"
    report["ttft"] = {"status": ttft["status"], "seconds": ttft["seconds"],
                      **(json.loads(result_file.read_text()) if ttft["status"] == 0 and result_file.exists() else
                         {"error": "see mm-ttft.log"})}  # fmt: skip
    save()
    print(ttft["tail"][-700:], flush=True)
    return report


SPEC_LADDER = {"2": 2, "5": 1}  # 1 running request: 3 drafts; 2-4: 2; 5 or more: 1


SPEC_RUNS = ("plain", "mtp3", "mtp3-ladder", "dflash4", "dflash4-eager", "dflash4-v1", "dflash3", "mtp4",
             "dflash4-reference", "dflash4-lbhnc", "dflash4-triton-attn", "dflash1", "dflash1-blnhc",
             "dflash1-reference", "dflash1-ref-hc", "dflash1-ref-norm-rope", "dflash1-ref-ple",
             "dflash1-ref-qsa-paged", "mtp3-tp2", "dflash3-tp2")  # fmt: skip
# -eager: without CUDA graphs; -v1: vLLM's V1 model runner; dflash3 / dflash1 / mtp4: is it the draft count?
# -reference: the plugin's torch references instead of its Triton kernels, eager (the references' boolean
# indexing cannot be captured); -lbhnc: the CPU's KV layout; -triton-attn: the drafter's attention layers on
# TRITON_ATTN instead of FLASH_ATTN; -blnhc: MTP's (block-outer) KV layout; -ref-OP: that op's torch reference
# alone (eager); -tp2: at tensor_parallel_size=2 (two GPUs; on the CPU two ranks, one core each), its tokens
# against the plain run's at TP=1 (issue 12 item 4: the DFlash drafter's column-parallel fc, K17, inside an
# engine); any run's name with -eager appended runs it without CUDA graphs
SPEC_DEFAULT_RUNS = SPEC_RUNS[:4]
REFERENCE_OPS = {f"QWEN38_{op}_REFERENCE": "1" for op in ("HC", "NORM_ROPE", "PLE", "QSA_PAGED")}


def spec(out: Path, work: Path, device: str, names: list[str], gpus: int) -> dict[str, Any]:
    """Step 6 (see the module's docstring); ``device`` cpu: a dry run in float32. ``gpus``: the
    CUDA devices here (a ``-tp2`` run on CUDA needs two)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the repository's tests package
    from dflash2.tiny import build_tiny_drafter
    from dflash2.view import make_view
    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint
    from tests.qwen38_plugin.test_qwen38_spec_verify_engine import MTP, two_token_checkpoint

    dtype = "float16" if device == "cuda" else "float32"
    env = {} if device == "cuda" else {"VLLM_CPU_KVCACHE_SPACE": "1"}
    root = work / f"spec-{dtype}"
    model = root / "target"
    if not model.exists():
        source = build_tiny_checkpoint(root / "source", "qwen4_exp_text", dtype=dtype, overrides=MTP, overwrite=True)
        two_token_checkpoint(source, model)
    view = root / "view"
    if not view.exists():
        make_view(build_tiny_drafter(root / "dflash", model, overwrite=True), view, max_position_embeddings=512)
    ref, margins = reference(model, dtype, device)
    report: dict[str, Any] = {"device": device, "dtype": dtype, "prompts": [len(p) for p in prompts(0)], "steps": STEPS}
    engine = {"max_num_batched_tokens": 64, "max_num_seqs": 16, "max_model_len": 512}
    verify = ROOT / "tests/qwen38_plugin/qwen38_engine_verify.py"

    def dflash_args(drafts: int) -> list[str]:
        return [str(ROOT / "tests/dflash2/spec_engine_run.py"), str(model),
                json.dumps({"method": "dflash", "model": str(view), "num_speculative_tokens": drafts}),
                json.dumps(prompts(0)), json.dumps([STEPS] * len(prompts(0)))]  # fmt: skip

    # the dispatcher refuses DFlash in vLLM's V1 runner on a GPU (no draft accepted there): lifted in the run's own
    # process, so that dflash4-v1 can study it
    dflash_engine = {**engine, "dtype": dtype, "enable_prefix_caching": False, "lift_gpu_dflash_refusal": True}
    dflash_eager = json.dumps({**dflash_engine, "enforce_eager": True})  # the references' indexing is not capturable
    runs: dict[str, tuple[list[str], dict[str, str]]] = {
        "plain": ([str(verify), str(model), dtype, str(STEPS), json.dumps(prompts(0)), "0", json.dumps(engine)], {}),
        "mtp3": ([str(verify), str(model), dtype, str(STEPS), json.dumps(prompts(0)), "3", json.dumps(engine)], {}),
        "mtp3-ladder": ([str(verify), str(model), dtype, str(STEPS), json.dumps(prompts(0)), "3",
                         json.dumps({**engine, "speculative_extra": {"dflash_concurrency_drafts": SPEC_LADDER}})], {}),
        "dflash4": ([*dflash_args(4), json.dumps(dflash_engine)], {}),
        "dflash4-eager": ([*dflash_args(4), dflash_eager], {}),
        "dflash4-v1": ([*dflash_args(4), json.dumps(dflash_engine)], RUNNER_ENV["v1"]),
        "dflash3": ([*dflash_args(3), json.dumps(dflash_engine)], {}),
        "mtp4": ([str(verify), str(model), dtype, str(STEPS), json.dumps(prompts(0)), "4", json.dumps(engine)], {}),
        "dflash4-reference": ([*dflash_args(4), dflash_eager], REFERENCE_OPS),
        "dflash4-lbhnc": ([*dflash_args(4), json.dumps(dflash_engine)], {"VLLM_KV_CACHE_LAYOUT": "LBHNC"}),
        "dflash4-triton-attn": ([*dflash_args(4), json.dumps({**dflash_engine, "attention_backend": "TRITON_ATTN"})],
                                {}),
        "dflash1": ([*dflash_args(1), json.dumps(dflash_engine)], {}),
        "dflash1-blnhc": ([*dflash_args(1), json.dumps(dflash_engine)], {"VLLM_KV_CACHE_LAYOUT": "BLNHC"}),
        "dflash1-reference": ([*dflash_args(1), dflash_eager], REFERENCE_OPS),
        **{f"dflash1-ref-{op.lower().replace('_', '-')}": (
            [*dflash_args(1), dflash_eager], {f"QWEN38_{op}_REFERENCE": "1"})
           for op in ("HC", "NORM_ROPE", "PLE", "QSA_PAGED")},
        "mtp3-tp2": ([str(verify), str(model), dtype, str(STEPS), json.dumps(prompts(0)), "3",
                      json.dumps({**engine, "tensor_parallel_size": 2})], TP2_ENV[device]),
        "dflash3-tp2": ([*dflash_args(3), json.dumps({**dflash_engine, "tensor_parallel_size": 2})], TP2_ENV[device]),
    }  # fmt: skip
    plain: list[list[int]] | None = None
    for name in names:
        if name not in runs and name.endswith("-eager") and name.removesuffix("-eager") in runs:
            # NAME-eager: run NAME without CUDA graphs (the engine arguments come last in every run)
            base_args, run_env = runs[name.removesuffix("-eager")]
            args = [*base_args[:-1], json.dumps({**json.loads(base_args[-1]), "enforce_eager": True})]
        else:
            args, run_env = runs[name]
        if device == "cuda" and "-tp2" in name and gpus < 2:
            report[name] = {"ok": False, "error": f"needs two GPUs; this machine has {gpus}"}
            print(f"spec {name}:", json.dumps(report[name]), flush=True)
            continue
        result = run(f"spec-{name}", [sys.executable, *args], out, 300, {**env, **run_env})
        lines = [line for line in (out / f"spec-{name}.log").read_text().splitlines() if line.startswith('{"tokens"')]
        if not lines:
            report[name] = {"ok": False, "error": f"engine failed: see spec-{name}.log", "tail": result["tail"][-600:]}
        else:
            served = json.loads(lines[-1])
            entry = {"vs_transformers": compare(served["tokens"], ref, margins, dtype), "seconds": result["seconds"]}
            if "spec_decode" in served:
                entry["spec_decode"] = served["spec_decode"]
            if "accepted" in served:
                drafted = sum(sum(row) for row in served["drafted"])
                entry["spec_decode"] = {"drafted": drafted, "accepted": sum(sum(row) for row in served["accepted"])}
            if name == "plain":
                plain = served["tokens"]
            entry["equals_plain"] = served["tokens"] == plain if plain is not None else "no plain run before it"
            entry["ok"] = entry["vs_transformers"]["ok"]
            report[name] = entry
        (out / "spec.json").write_text(json.dumps(report, indent=2))
        print(f"spec {name}:", json.dumps(report[name]), flush=True)
    return report


RUNNER_ENV = {"v2": {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
# a spec run at tensor_parallel_size=2: on CUDA the machine's first two GPUs; on the CPU a core per rank
TP2_ENV: dict[str, dict[str, str]] = {"cuda": {}, "cpu": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
# graphs: vLLM's default for the Qwen4ExpForCausalLM architecture on CUDA, breakable CUDA graphs
# without torch.compile; compiled: torch.compile with piecewise and full CUDA graphs.
MODE_ENV = {"graphs": {}, "compiled": {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}, "eager": {}}
STEPS_OF_SESSION = ("ops", "exact", "tp2", "bench", "mm", "spec")
DEFAULT_STEPS = ("ops", "exact", "tp2", "bench")  # mm and spec only when named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", default=",".join(DEFAULT_STEPS), help=f"of {', '.join(STEPS_OF_SESSION)}")
    parser.add_argument("--runners", default="v2,v1")
    parser.add_argument("--dtypes", default="float16,bfloat16", help="of the exact step (float32: refused on CUDA)")
    parser.add_argument("--modes", default="graphs,compiled,eager", help="of the exact step")
    parser.add_argument("--work", type=Path, default=Path("/tmp/qwen38_gpu_session"))
    parser.add_argument("--bench-args", default="", help="extra arguments for bench_gpu.py")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="of the mm and spec steps: cpu is a dry run (float32; mm: small media, one tower block)",
    )
    parser.add_argument("--spec-runs", default=",".join(SPEC_DEFAULT_RUNS),
                        help=f"of the spec step, of {', '.join(SPEC_RUNS)}")  # fmt: skip
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    unknown = only - set(STEPS_OF_SESSION)
    if unknown:
        parser.error(f"--only: unknown steps {sorted(unknown)}; choose from {', '.join(STEPS_OF_SESSION)}")
    runners = [r for r in args.runners.split(",") if r]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    import torch

    gpus = torch.cuda.device_count()
    summary: dict[str, Any] = {"gpus": gpus, "name": torch.cuda.get_device_name() if gpus else None}
    if "ops" in only:
        tests = [
            "tests/qwen38_plugin/on_cuda",
            "tests/qwen38_plugin/test_qwen38_qsa_paged.py",
            "tests/qwen38_plugin/test_qwen38_fused_ops.py",
            "tests/qwen38_plugin/test_qwen38_gdn_varlen.py",
            "tests/qwen38_plugin/test_qwen38_ple_varlen.py",
        ]
        cmd = [sys.executable, "-m", "pytest", "--noconftest", "-q", "-rA", "-p", "no:cacheprovider", *tests]
        path = f"{ROOT / 'src/qwen38_plugin'}:{ROOT}:{os.environ.get('PYTHONPATH', '')}"
        summary["ops"] = run("ops", cmd, out, 420, {"PYTHONPATH": path})
        print("ops:", summary["ops"]["status"], summary["ops"]["tail"][-300:], flush=True)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if "exact" in only:
        summary["exact"] = exact(out, args.work, runners, dtypes, args.modes.split(","))
    if "tp2" in only:
        summary["tp2"] = tp2(out, args.work, runners, dtypes[0]) if gpus >= 2 else "needs two GPUs"
    if "bench" in only:
        cmd = [sys.executable, str(ROOT / "benchmarks/qwen38_plugin/bench_gpu.py"), str(out), "--stock",
               "--work", str(args.work), *args.bench_args.split()]  # fmt: skip
        summary["bench"] = run("bench", cmd, out, 3000)
        print(summary["bench"]["tail"], flush=True)
    if "mm" in only:
        if args.device == "cuda" and not gpus:
            parser.error("--only mm: no CUDA device here; --device cpu runs the step on the CPU (a dry run)")
        summary["mm"] = mm(out, args.work, args.device)
    if "spec" in only:
        runs = [r for r in args.spec_runs.split(",") if r]
        unknown_runs = {r for r in runs if r not in SPEC_RUNS and r.removesuffix("-eager") not in SPEC_RUNS}
        if unknown_runs:
            parser.error(f"--spec-runs: unknown {sorted(unknown_runs)}; choose from {SPEC_RUNS} (each also NAME-eager)")
        summary["spec"] = spec(out, args.work, args.device, runs, gpus)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
