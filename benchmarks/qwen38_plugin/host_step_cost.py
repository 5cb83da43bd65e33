"""Host (Python) cost of one vLLM decode step, by part: our Qwen4Exp vs a pure-attention peer,
prefix caching on vs off.

    .venv/bin/python benchmarks/qwen38_plugin/host_step_cost.py [--batches 32,64] [--new-tokens 32]
        [--config tiny] [--models ours,peer] [--profile]

Why: on an H200 our model decodes 1.2x-1.6x faster with ``enable_prefix_caching=False`` than with
vLLM's default (prefix caching on, which for a hybrid model also sets ``mamba_cache_mode="align"``),
and the GPU step is host-bound (results/h200_bench_gpu.txt). The scheduler, the KV cache manager
and the model runner's input preparation are the same Python code on CPU and GPU, so their cost
per step can be measured here; only the model forward differs.

What it measures. For each model (``ours``: the tiny checkpoint builder's ``qwen4_exp_text`` of
``--config``, six KV-cache groups; ``peer``: a random stock ``Qwen3MoeForCausalLM`` of the same
geometry, one group; both built as bench_gpu.py builds them) and each prefix-caching setting, one
child process runs ``vllm.LLM`` in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, KV
cache manager and model runner in one Python process) holding every engine core (tests/engines.py). For each batch
B it submits B requests of ``--prompt-len`` random tokens (distinct per request, so no prefix hits)
decoding ``--new-tokens`` tokens (``ignore_eos``) once as a warm-up and ``--repeats`` times measured. During the
measured run, wrappers with ``time.perf_counter`` (inclusive times; a method nested in another is
counted inside it too) time, per engine step:

- ``step``: the engine core's step function (``EngineCore.step`` or ``step_with_batch_queue``), all;
- ``schedule`` / ``update_from_output``: ``Scheduler.schedule()`` / ``Scheduler.update_from_output()``;
- ``kv.*``: ``KVCacheManager`` calls (allocate_slots, free, cache_blocks, remove_skipped_blocks,
  get_computed_blocks, new_step_starts), and ``kv.g<i>``: all calls into the single-type manager of
  KV-cache group i (its class in the group list below); ``hash``: ``Request.update_block_hashes``;
- ``runner.*``: the model runner's ``_update_states``, ``_prepare_inputs``,
  ``_build_attention_metadata`` (and in it ``build.g<i>``: the metadata builders of group i),
  ``mamba_utils.preprocess_mamba`` (align mode only), the block-table methods, ``execute_model``,
  ``sample_tokens``, and ``_model_forward`` (the forward itself: CPU time here, not comparable).

Only decode steps are kept: steps whose ``schedule()`` returned B running requests of one token
each and no new request. ``prep`` sums the disjoint parts schedule + update_from_output +
update_states + prepare_inputs + attention metadata + mamba align preprocess: the host work of a
step that is the same Python on a GPU and does not wait on the device. The sampler, the forward
(and the engine step that holds them) are CPU compute here and marked n/c (not comparable with a
GPU). The per-group KV manager times ``kv.g<i>`` come from a second pass of the same runs with
extra wrappers on each group's manager (many calls a step; their call counts are printed, and
those wrappers' own cost, about 1 us a call, is inside these numbers but not in the main pass).

The table prints the median over decode steps of microseconds per step and, measured in the same run, the ratios
prefix on / off and ours / peer; then, with two or more batches, the cost per extra request
(slope between the smallest and the largest batch). ``--profile`` adds a cProfile of one more run
at the largest batch in each child (all steps, including the forward; the timers are off then):
the top functions by own time in vLLM's core/worker/attention code and the plugin.

Unchanged on a GPU: the same children run with vLLM's defaults there (CUDA graphs, async
scheduling: step_with_batch_queue); ``--eager`` forces ``enforce_eager`` (the default on CPU). There
vLLM 0.32 runs its V2 model runner, whose methods are not wrapped: the ``runner.*`` rows stay empty,
the scheduler, KV-cache manager, metadata builders and engine step are measured
(results/host_step_cost_h100.txt).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# Columns of the table: label, header. Labels are the timer names (see the docstring).
COLUMNS: list[tuple[str, str]] = [
    ("prep", "host: sched + kv + runner prep"),
    ("schedule", "schedule"),
    ("kv.allocate_slots", "  kv allocate_slots"),
    ("update_from_output", "update_from_output"),
    ("kv.free", "  kv free"),
    ("hash", "  block hashing"),
    ("kv.all", "kv manager (all calls)"),
    ("runner._update_states", "runner update_states"),
    ("runner._prepare_inputs", "runner prepare_inputs"),
    ("runner.block_table", "  block table"),
    ("runner._build_attention_metadata", "attn metadata (all groups)"),
    ("runner.preprocess_mamba", "mamba align preprocess"),
    ("runner._bookkeeping_sync", "runner bookkeeping_sync"),
    ("runner._sample", "sampler (CPU compute, n/c)"),
    ("runner._model_forward", "forward (CPU compute, n/c)"),
    ("step", "engine step (all, n/c)"),
]
# Disjoint parts summed into "prep": the host work of a step that does not depend on the device.
PREP = (
    "schedule",
    "update_from_output",
    "runner._update_states",
    "runner._prepare_inputs",
    "runner._build_attention_metadata",
    "runner.preprocess_mamba",
)
KV_CALLS = ("allocate_slots", "free", "cache_blocks", "remove_skipped_blocks", "get_computed_blocks", "new_step_starts")


# --------------------------------------------------------------------------- child: timers


class Timers:
    """Inclusive perf_counter timers per label, collected per engine step while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.cur: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.active: set[str] = set()
        self.decode = False
        self.batch = 0
        self.steps: list[dict[str, float]] = []
        self.other_steps = 0

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on or label in self.active:  # outermost call of a label only
                return fn(*args, **kwargs)
            self.active.add(label)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cur[label] += time.perf_counter() - t0
                self.calls[label] += 1
                self.active.discard(label)

        return timed

    def wrap_step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def step(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            self.cur = defaultdict(float)
            self.calls = defaultdict(int)
            self.decode = False
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.cur["step"] = time.perf_counter() - t0
            if self.decode:
                self.steps.append({**self.cur, **{f"calls:{k}": v for k, v in self.calls.items()}})
            else:
                self.other_steps += 1
            return out

        return step

    def note_schedule(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if self.on:
                counts = list(out.num_scheduled_tokens.values())
                self.decode = not out.scheduled_new_reqs and len(counts) == self.batch and all(c == 1 for c in counts)
            return out

        return schedule


def patch_method(timers: Timers, owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name, None)
    if fn is not None:
        setattr(owner, name, timers.wrap(label, fn))


def patch_classes(timers: Timers) -> None:
    """Class-level wrappers, before the engine exists."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request
    from vllm.v1.worker import mamba_utils
    from vllm.v1.worker.block_table import MultiGroupBlockTable
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    Scheduler.schedule = timers.note_schedule(timers.wrap("schedule", Scheduler.schedule))
    patch_method(timers, Scheduler, "update_from_output", "update_from_output")
    for name in KV_CALLS:
        patch_method(timers, KVCacheManager, name, f"kv.{name}")
    patch_method(timers, Request, "update_block_hashes", "hash")
    for name in ("_update_states", "_prepare_inputs", "_build_attention_metadata", "_sample", "_bookkeeping_sync"):
        patch_method(timers, GPUModelRunner, name, f"runner.{name}")
    patch_method(timers, GPUModelRunner, "_model_forward", "runner._model_forward")
    patch_method(timers, mamba_utils, "preprocess_mamba", "runner.preprocess_mamba")
    for name in ("append_row", "add_row", "compute_slot_mapping", "commit_block_table", "move_row", "swap_row"):
        patch_method(timers, MultiGroupBlockTable, name, "runner.block_table")


def patch_instances(timers: Timers, llm: Any) -> dict[str, Any]:
    """Instance-level wrappers on the built engine: the step and each group's metadata builders."""
    core = llm.llm_engine.engine_core.engine_core
    core.step_fn = timers.wrap_step(core.step_fn)
    coordinator = core.scheduler.kv_cache_manager.coordinator
    groups = [
        f"g{gid}: {type(manager.kv_cache_spec).__name__} -> {type(manager).__name__}"
        for gid, manager in enumerate(coordinator.single_type_managers)
    ]
    runner = core.model_executor.driver_worker.worker.model_runner
    builders: list[str] = []
    for gid, attn_groups in enumerate(runner.attn_groups):
        for attn_group in attn_groups:
            for builder in attn_group.metadata_builders:
                builders.append(f"g{gid}: {type(builder).__name__}")
                patch_method(timers, builder, "build", f"build.g{gid}")
                patch_method(timers, builder, "update_block_table", f"build.g{gid}")
    cache_config = core.vllm_config.cache_config
    return {
        "groups": groups,
        "builders": builders,
        "mamba_cache_mode": cache_config.mamba_cache_mode,
        "prefix_caching": cache_config.enable_prefix_caching,
        "coordinator": type(coordinator).__name__,
        "step_fn": core.step_fn.__name__,
        "async_scheduling": bool(core.vllm_config.scheduler_config.async_scheduling),
    }


MANAGER_CALLS = (
    "get_num_blocks_to_allocate",
    "allocate_new_blocks",
    "allocate_new_computed_blocks",
    "cache_blocks",
    "remove_skipped_blocks",
    "free",
    "pop_blocks_for_free",
    "new_step_starts",
    "take_new_block_ids",
)


def patch_managers(timers: Timers, llm: Any, on: bool) -> None:
    """The detail pass: wrap (``on``) or unwrap every call into each group's single-type manager.
    These calls are many (per request, per group, several a step), so the wrappers' own cost
    (about a microsecond a call, counted in ``calls:kv.g<i>``) is kept out of the main pass."""
    coordinator = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator
    for gid, manager in enumerate(coordinator.single_type_managers):
        for name in MANAGER_CALLS:
            if on:
                patch_method(timers, manager, name, f"kv.g{gid}")
            elif name in vars(manager):
                delattr(manager, name)


def child(args: argparse.Namespace) -> None:
    import torch

    timers = Timers()
    patch_classes(timers)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "max_model_len": args.prompt_len + args.new_tokens + 64,
        "max_num_seqs": max(args.batches),
        "max_num_batched_tokens": max(2048, max(args.batches) * args.prompt_len),
        "enable_prefix_caching": args.prefix == "on",
        "seed": 0,
        "dtype": args.dtype,
    }
    if args.eager:
        kwargs["enforce_eager"] = True
    kwargs.update(json.loads(args.engine_kwargs))
    llm = LLM(model=args.model, **kwargs)
    info = patch_instances(timers, llm)
    info["torch_threads"] = torch.get_num_threads()
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def prompts(n: int) -> list[Any]:
        return [
            TokensPrompt(prompt_token_ids=[rng.randrange(10, vocab) for _ in range(args.prompt_len)]) for _ in range(n)
        ]

    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()

    def measure(batch: int) -> tuple[dict[str, float], int, int, float]:
        timers.steps, timers.other_steps, timers.batch = [], 0, batch
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            timers.on = True
            llm.generate(prompts(batch), params, use_tqdm=False)
            timers.on = False
        wall = (time.perf_counter() - t0) / args.repeats
        for step in timers.steps:
            step["prep"] = sum(step.get(label, 0.0) for label in PREP)
            step["kv.all"] = sum(step.get(f"kv.{name}", 0.0) for name in KV_CALLS)
        labels = sorted({label for step in timers.steps for label in step})
        n = len(timers.steps)
        # Median over the decode steps: robust to steps slowed by other work on a shared machine.
        mid = {label: statistics.median(step.get(label, 0.0) for step in timers.steps) for label in labels} if n else {}
        mid = {k: v if k.startswith("calls:") else v * 1e6 for k, v in mid.items()}
        return mid, n, timers.other_steps, wall

    results: dict[str, Any] = {}
    for batch in args.batches:
        llm.generate(prompts(batch), params, use_tqdm=False)  # warm-up
        mean, n, others, wall = measure(batch)
        results[str(batch)] = {"decode_steps": n, "other_steps": others, "wall_s": wall, "us": mean}
        if args.detail:
            patch_managers(timers, llm, on=True)
            detail, *_ = measure(batch)
            patch_managers(timers, llm, on=False)
            mean.update({k: v for k, v in detail.items() if k.startswith(("kv.g", "calls:kv.g"))})
    if profile is not None:  # a run of its own: the profiler's overhead must not reach the timers
        profile.enable()
        llm.generate(prompts(max(args.batches)), params, use_tqdm=False)
        profile.disable()
    if profile is not None:
        import io
        import pstats

        buf = io.StringIO()
        stats = pstats.Stats(profile, stream=buf).sort_stats("tottime")
        stats.print_stats(r"vllm/v1/(core|worker|attention|request)|qwen38_plugin", args.profile_top)
        info["profile"] = buf.getvalue()
    print("HOST_STEP_COST " + json.dumps({"info": info, "results": results}), flush=True)


# --------------------------------------------------------------------------- parent


def build_models(args: argparse.Namespace) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT / "benchmarks" / "qwen38_plugin"))
    from bench_gpu import build_checkpoint, build_peer_checkpoint

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    models: dict[str, Path] = {}
    if "ours" in args.models:
        models["ours"] = build_checkpoint(work, args.config, args.dtype, stock_gate=False)
    if "peer" in args.models:
        models["peer"] = build_peer_checkpoint(work, args.config, args.dtype)
    return models


def run_child(args: argparse.Namespace, model: Path, prefix: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "engines.py"),  # holds every engine core of the repository's tests meanwhile
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--model",
        str(model),
        "--prefix",
        prefix,
        "--batches",
        ",".join(map(str, args.batches)),
        "--new-tokens",
        str(args.new_tokens),
        "--prompt-len",
        str(args.prompt_len),
        "--dtype",
        args.dtype,
        "--engine-kwargs",
        args.engine_kwargs,
        "--repeats",
        str(args.repeats),
        "--profile-top",
        str(args.profile_top),
    ]
    cmd += ["--eager"] if args.eager else []
    cmd += ["--profile"] if args.profile else []
    cmd += [] if args.detail else ["--no-detail"]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("HOST_STEP_COST "):
            return json.loads(line[len("HOST_STEP_COST ") :])
    tail = (proc.stdout + proc.stderr)[-3000:]
    return {"error": f"rc={proc.returncode}: {tail}"}


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def print_report(args: argparse.Namespace, runs: dict[tuple[str, str], dict[str, Any]]) -> None:
    for (model, prefix), run in runs.items():
        if "error" in run:
            print(f"## {model} prefix {prefix}: FAILED {run['error']}")
            continue
        info = run["info"]
        print(
            f"## {model}, prefix caching {prefix}: mamba_cache_mode={info['mamba_cache_mode']}, "
            f"{info['coordinator']}, step_fn={info['step_fn']}, async_scheduling={info['async_scheduling']}, "
            f"torch threads {info['torch_threads']}"
        )
        print("#   KV-cache groups (spec -> manager): " + "; ".join(info["groups"]))
        print("#   metadata builders: " + "; ".join(info["builders"]))
        for batch, res in run["results"].items():
            print(f"#   batch {batch}: {res['decode_steps']} decode steps kept, {res['other_steps']} others")
    print()
    print("Median host microseconds per decode step (inclusive; kv calls are inside schedule/update_from_output).")
    for batch in map(str, args.batches):
        print(f"\n### batch {batch}")
        keys = [(m, p) for (m, p) in runs if "error" not in runs[(m, p)]]
        header = "| part | " + " | ".join(f"{m} pc-{p}" for m, p in keys)
        extra = []
        for m in args.models:
            if (m, "on") in runs and (m, "off") in runs:
                extra.append(f"{m} on/off")
        for p in ("on", "off"):
            if ("ours", p) in runs and ("peer", p) in runs:
                extra.append(f"ours/peer pc-{p}")
        print(header + " | " + " | ".join(extra) + " |")
        print("|---" * (1 + len(keys) + len(extra)) + "|")

        def get(m: str, p: str, label: str, batch: str = batch) -> float | None:
            run = runs.get((m, p))
            if not run or "error" in run:
                return None
            return run["results"][batch]["us"].get(label)

        labels = [c[0] for c in COLUMNS]
        names = dict(COLUMNS)
        for label in sorted(
            {lab for k in keys for lab in runs[k]["results"][batch]["us"] if lab.startswith(("kv.g", "build.g"))}
        ):
            labels.append(label)
            names[label] = label
        for label in labels:
            if label.startswith("kv.g"):
                calls = [get(m, p, "calls:" + label) for m, p in keys]
                names[label] = label + " (calls " + "/".join(fmt(c) for c in calls) + ")"
            cells = [fmt(get(m, p, label)) for m, p in keys]
            ext = []
            for m in args.models:
                if (m, "on") in runs and (m, "off") in runs:
                    ext.append(ratio(get(m, "on", label), get(m, "off", label)))
            for p in ("on", "off"):
                if ("ours", p) in runs and ("peer", p) in runs:
                    ext.append(ratio(get("ours", p, label), get("peer", p, label)))
            print(f"| {names[label]} | " + " | ".join(cells) + " | " + " | ".join(ext) + " |")
    if len(args.batches) > 1:
        lo, hi = str(min(args.batches)), str(max(args.batches))
        keys = [k for k in runs if "error" not in runs[k]]
        print(f"\n### microseconds per extra request per step (slope batch {lo} -> {hi})")
        print("| part | " + " | ".join(f"{m} pc-{p}" for m, p in keys) + " |")
        print("|---" * (1 + len(keys)) + "|")
        for label, name in COLUMNS:
            if "n/c" in name:
                continue
            cells = []
            for k in keys:
                us = runs[k]["results"]
                a, b = us[lo]["us"].get(label), us[hi]["us"].get(label)
                cells.append("-" if a is None or b is None else f"{(b - a) / (int(hi) - int(lo)):.1f}")
            print(f"| {name} | " + " | ".join(cells) + " |")
    for (model, prefix), run in runs.items():
        if "profile" in run.get("info", {}):
            print(f"\n## cProfile, {model} prefix {prefix}, batch {max(args.batches)} (an extra run, all steps)")
            print(run["info"]["profile"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="32,64", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="measured runs per batch (decode steps pooled)")
    parser.add_argument("--config", default="tiny", help="a bench_cpu.py CONFIGS name (tiny, medium)")
    parser.add_argument("--models", default="ours,peer", type=lambda s: s.split(","))
    parser.add_argument("--prefix-modes", default="on,off", type=lambda s: s.split(","))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--eager", action="store_true", default=None, help="enforce_eager (default on CPU)")
    parser.add_argument("--engine-kwargs", default="{}", help="extra vllm.LLM kwargs as JSON")
    parser.add_argument("--work", default=str(ROOT / ".cache" / "bench"))
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--no-detail", dest="detail", action="store_false", help="skip the per-group KV manager pass (kv.g<i>)"
    )
    parser.add_argument("--profile-top", type=int, default=30)
    # child only
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.eager is None:
        import torch

        args.eager = not torch.cuda.is_available()
    models = build_models(args)
    print(f"# host_step_cost.py {' '.join(sys.argv[1:])}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {platform.node()}, {platform.processor() or platform.machine()}")
    print(f"# config {args.config}, dtype {args.dtype}, prompt {args.prompt_len}, new tokens {args.new_tokens}")
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for model, path in models.items():
        for prefix in args.prefix_modes:
            runs[(model, prefix)] = run_child(args, path, prefix)
    print_report(args, runs)


if __name__ == "__main__":
    main()
