"""Loading a CSF checkpoint against loading its uncompressed source: time, peak host and GPU memory.

    python benchmarks/csf_loader/load_overhead.py SOURCE CSF [--repeats 3] [--dtype auto] [--json OUT]

Each load runs in a fresh process (alternating source, CSF, source, ...) on the machine's device
(CUDA when present, else CPU) through stock vLLM's own loader: the model is built from the
checkpoint's config and ``get_model_loader(load_config).load_model(...)`` loads it, with
``--load-format auto`` for the source and ``csf`` for the CSF checkpoint (this repository's
plugins registered as vLLM registers them). Nothing else runs: no KV cache, no profiling run. Both
checkpoints' files are read once before the first load (warm page cache). Per load it measures:

* ``load_s``: wall time of ``load_model`` (model built, weights streamed and loaded, weights
  processed); ``weights_s``: stock's own "Loading weights took" interval (the weight stream);
* ``host_peak_bytes``: the process's peak resident memory during the load above its resident
  memory before it (sampled every 2 ms), and ``host_hwm_bytes`` (the kernel's high-water mark);
* ``gpu_peak_bytes`` / ``gpu_after_bytes``: ``torch.cuda.max_memory_allocated`` during the load
  and ``memory_allocated`` after it (CUDA only);
* ``first_triton_s`` (CUDA only): after the load, the engine's first Triton launch (stock's slot
  mapping of a step, ``BlockTable.compute_slot_mapping``, as the profiling run makes it), where a
  process pays Triton's per-process start unless the load already did (a CSF load's decode kernel
  is Triton); ``ready_s``: ``load_s`` plus it, what each process has paid when a step can run.

The run starts with an empty Triton cache of its own (``TRITON_CACHE_DIR`` in a temporary folder,
shared by its children), so the first CSF load on CUDA compiles the decode kernel, as a machine's
first CSF load does, and the later ones find it compiled, as every later load does. The first load
of each format is reported apart (``first``), and the medians and ratios are over the loads after
it when there are at least two (``--repeats`` >= 2; over all of them otherwise).

Prints the medians and the CSF / source ratios; ``--json`` writes every sample too (and, while the
run goes on, the loads finished so far: ``{"partial": true, "loads": ...}``). ``--read-ahead`` adds
loads of the CSF checkpoint with ``CSF_LOADER_READ_AHEAD=1`` (the stream on a thread ahead of stock's
copies; in line by default) to the alternation, so the read-ahead's gain is measured in the same run. The CSF load
should not be slower than the source's: on CUDA the planes are decoded on the GPU by the Triton
kernel as they stream in (``csf_loader.device_decode``), on CPU by the torch codec.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler(threading.Thread):
    """Samples the process's resident memory until stopped; ``peak`` is the largest sample."""

    def __init__(self, period: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.period, self.peak, self._halt = period, rss_bytes(), threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.period)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


def child(model: str, load_format: str, dtype: str) -> dict[str, Any]:
    """One load in this process; returns the measurements."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port

    # a load that hangs prints every thread's stack before the caller's limit kills it (on the H200 on
    # 2026-12-01 a child hung without a word for 300 s)
    faulthandler.dump_traceback_later(float(os.environ.get("LOAD_OVERHEAD_CHILD_STACK_AFTER", "150")), exit=True)
    load_general_plugins()
    cuda = torch.cuda.is_available()
    args = EngineArgs(model=model, load_format=load_format, dtype=dtype, enforce_eager=True, max_model_len=256)
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        if cuda:
            torch.cuda.set_device(0)
        # the init method vLLM's own workers use (a TCP store on loopback), not a file store
        init_distributed_environment(
            1,
            0,
            distributed_init_method=get_distributed_init_method("127.0.0.1", get_open_port()),
            local_rank=0,
            backend="nccl" if cuda else "gloo",
        )
        initialize_model_parallel(1, 1)
        loader = get_model_loader(vllm_config.load_config)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            gpu_before = torch.cuda.memory_allocated()
        before = rss_bytes()
        sampler = PeakSampler()
        sampler.start()
        started = time.perf_counter()
        model = loader.load_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
        if cuda:
            torch.cuda.synchronize()
        load_s = time.perf_counter() - started
        peak = sampler.stop()
        result: dict[str, Any] = {
            "format": load_format,
            "device": "cuda" if cuda else "cpu",
            "load_s": load_s,
            "weights_s": loader.counter_after_loading_weights - loader.counter_before_loading_weights,
            "host_peak_bytes": peak - before,
            "host_after_bytes": rss_bytes() - before,
            "host_hwm_bytes": hwm_bytes(),
            "parameters_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        }
        if cuda:
            result["gpu_peak_bytes"] = torch.cuda.max_memory_allocated() - gpu_before
            result["gpu_after_bytes"] = torch.cuda.memory_allocated() - gpu_before
            try:
                result["first_triton_s"] = engine_first_triton_launch(vllm_config)
                result["ready_s"] = load_s + result["first_triton_s"]
            except Exception as exc:  # the load's own numbers still count; the report says what failed
                result["first_triton_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return result


def engine_first_triton_launch(vllm_config: Any) -> float:
    """Seconds of the first Triton launch a vLLM GPU engine makes after loading: its first step's
    slot mapping (stock's ``BlockTable.compute_slot_mapping``, a Triton kernel in every step of the
    V1 GPU runner, the profiling run's included; the V2 runner prepares its steps with Triton kernels
    of its own), run here once as the V1 runner runs it.

    Triton's first launch in a process pays its per-process start (hashing its installation, 0.5 s
    on the H100 host, 4-5 s on the H200 host of 2026-12-06) before the kernel's own cache lookup. A
    CSF load on CUDA pays that start beside the load (its decode kernel is Triton); the source's
    process pays it here, at the engine's first step. ``ready_s`` (load plus this launch) is the
    comparison of what each process has paid when the engine can run a step.
    """
    import torch
    from vllm.v1.worker.block_table import BlockTable

    device = torch.device("cuda", torch.cuda.current_device())
    block_size, tokens = vllm_config.cache_config.block_size or 16, 4
    table = BlockTable(
        block_size=block_size,
        max_num_reqs=1,
        max_num_blocks_per_req=1,
        max_num_batched_tokens=tokens,
        pin_memory=True,
        device=device,
        cp_kv_cache_interleave_size=1,
    )
    table.add_row([3], 0)
    table.commit_block_table(1)
    query_start_loc = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    positions = torch.arange(tokens, dtype=torch.int64, device=device)
    torch.cuda.synchronize()
    started = time.perf_counter()
    table.compute_slot_mapping(1, query_start_loc, positions)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    # the launch did the engine's work: block 3's first slots
    expected = 3 * block_size + positions
    if not torch.equal(table.slot_mapping.gpu[:tokens], expected):
        raise SystemExit(f"slot mapping {table.slot_mapping.gpu[:tokens].tolist()} != {expected.tolist()}")
    return seconds


def run_child(
    model: Path, load_format: str, dtype: str, log: Path | None, triton_cache: Path, extra: dict[str, str] | None = None
) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRITON_CACHE_DIR=str(triton_cache), **(extra or {}))
    cmd = [sys.executable, __file__, "--child", str(model), load_format, "--dtype", dtype]
    # the child writes into a file, copied to the log even when a limit stops it, so what it printed
    # (a hang's stacks included) survives
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as output:
        try:
            code = subprocess.run(cmd, stdout=output, stderr=subprocess.STDOUT, env=env, timeout=1800).returncode
        finally:
            output.seek(0)
            printed = output.read()
            if log is not None:
                with log.open("a") as f:
                    f.write(f"\n===== {load_format} {model}\n{printed}")
    lines = [line for line in printed.splitlines() if line.startswith('{"format"')]
    if code != 0 or not lines:
        raise SystemExit(f"load of {model} ({load_format}) failed (exit {code}):\n{printed[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    decoded = [line for line in printed.splitlines() if "csf_loader: decoded" in line]
    result["decode_log"] = decoded[-1].split("csf_loader: ", 1)[-1] if decoded else None
    return result


def loads_so_far(samples: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, float]]]:
    """Each finished load's times and peaks, in the order they ran (the partial report)."""
    keep = ("load_s", "weights_s", "host_peak_bytes", "gpu_peak_bytes", "first_triton_s", "ready_s")
    return {label: [{k: s[k] for k in keep if k in s} for s in runs] for label, runs in samples.items()}


def warm(path: Path) -> None:
    for file in sorted(path.rglob("*.safetensors")):
        with file.open("rb") as f:
            while f.read(1 << 24):
                pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, nargs="?")
    parser.add_argument("csf", type=Path, nargs="?")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=None, help="append every child's output here")
    parser.add_argument(
        "--read-ahead",
        action="store_true",
        help="also load the CSF checkpoint with CSF_LOADER_READ_AHEAD=1 (its stream on a thread ahead of stock's "
        "copies), in the same alternation: the read-ahead's own gain in one run",
    )
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "FORMAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.dtype)), flush=True)
        return 0
    if args.source is None or args.csf is None:
        parser.error("SOURCE and CSF are required")
    warm(args.source)
    warm(args.csf)
    samples: dict[str, list[dict[str, Any]]] = {"source": [], "csf": []}
    if args.read_ahead:
        samples["csf-read-ahead"] = []
    runs: list[tuple[str, Path, str, dict[str, str] | None]] = [
        ("source", args.source, "auto", None),
        ("csf", args.csf, "csf", None),
    ]
    if args.read_ahead:
        runs.append(("csf-read-ahead", args.csf, "csf", {"CSF_LOADER_READ_AHEAD": "1"}))
    with tempfile.TemporaryDirectory(prefix="load-overhead-triton-") as triton_cache:
        for _ in range(args.repeats):
            for label, model, load_format, extra in runs:
                samples[label].append(run_child(model, load_format, args.dtype, args.log, Path(triton_cache), extra))
                if args.json:
                    # every finished load is on disk at once: a caller's time limit that stops the run keeps them
                    # (2026-12-05: nine children of about 35 s each outran a 300 s limit and took all eight
                    # finished samples with them); the full report below replaces this
                    args.json.write_text(json.dumps({"partial": True, "loads": loads_so_far(samples)}, indent=1))
    keys = ["load_s", "weights_s", "host_peak_bytes", "host_hwm_bytes"]
    if "gpu_peak_bytes" in samples["source"][0]:
        keys += ["gpu_peak_bytes", "gpu_after_bytes"]
    failed = {s["first_triton_error"] for runs in samples.values() for s in runs if "first_triton_error" in s}
    if failed:
        print(f"the engine's first Triton launch was not measured: {sorted(failed)}")
    elif "ready_s" in samples["source"][0]:
        keys += ["first_triton_s", "ready_s"]
    # the first load of each format apart: on CUDA the first CSF load compiles the decode kernel
    later = 1 if args.repeats >= 2 else 0
    first = {label: {k: runs[0][k] for k in keys} for label, runs in samples.items()}
    medians = {
        label: {k: statistics.median(s[k] for s in runs[later:]) for k in keys} for label, runs in samples.items()
    }
    ratios = {k: medians["csf"][k] / medians["source"][k] if medians["source"][k] else None for k in keys}
    read_ahead_ratios = (
        {k: medians["csf-read-ahead"][k] / medians["source"][k] if medians["source"][k] else None for k in keys}
        if args.read_ahead
        else None
    )
    device = samples["source"][0]["device"]
    size = {label: sum(p.stat().st_size for p in path.rglob("*.safetensors")) for label, path in
            (("source", args.source), ("csf", args.csf))}  # fmt: skip
    over = f"loads 2-{args.repeats}" if later else f"{args.repeats} load(s)"
    decoded = samples["csf"][-1]["decode_log"]
    print(f"device {device}, {args.repeats} loads each, medians of {over} (CSF decode: {decoded})")
    print(
        f"first loads (a fresh Triton cache): load_s source {first['source']['load_s']:.3f}  csf "
        f"{first['csf']['load_s']:.3f} (CSF decode: {samples['csf'][0]['decode_log']})"
    )
    print(f"checkpoint bytes: source {size['source']:,}  csf {size['csf']:,}")
    for k in keys:
        unit = 1e6 if k.endswith("bytes") else 1.0
        name = f"{k} ({'MB' if unit == 1e6 else 's'})"
        ratio = ratios[k]
        print(
            f"  {name:<24} source {medians['source'][k] / unit:10.3f}   csf {medians['csf'][k] / unit:10.3f}"
            f"   csf/source {ratio:.3f}"
            if ratio is not None
            else f"  {name:<24} source {medians['source'][k] / unit:10.3f}   csf {medians['csf'][k] / unit:10.3f}"
        )
    if read_ahead_ratios is not None:
        print(
            "  csf with CSF_LOADER_READ_AHEAD=1 (a thread ahead): "
            + ", ".join(
                f"{k} {medians['csf-read-ahead'][k]:.3f} s ({read_ahead_ratios[k]:.3f}x)"
                for k in ("load_s", "weights_s")
            )
            + f"; its decode: {samples['csf-read-ahead'][-1]['decode_log']}"
        )
    verdict = medians["csf"]["load_s"] <= medians["source"]["load_s"]
    print(f"CSF load not slower than the source's: {verdict}")
    ready_verdict = None
    if "ready_s" in keys:
        # the source's process pays Triton's per-process start at the engine's first step; a CSF load on
        # CUDA paid it during the load (engine_first_triton_launch)
        ready_verdict = medians["csf"]["ready_s"] <= medians["source"]["ready_s"]
        print(f"CSF load + the engine's first Triton launch not slower than the source's: {ready_verdict}")
    if args.json:
        report = {"device": device, "sizes": size, "medians_over": over, "medians": medians, "ratios": ratios,
                  "read_ahead_ratios": read_ahead_ratios, "first": first, "samples": samples}  # fmt: skip
        args.json.write_text(
            json.dumps({**report, "csf_not_slower": verdict, "csf_ready_not_slower": ready_verdict}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
