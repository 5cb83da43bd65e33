"""The soak of tests/soak (issue 17) against a server on whatever device this machine has: on the
lent H200 with CUDA graphs (vLLM's default there), on CPU as in CI.

    python benchmarks/soak_gpu.py OUT [--dtype float16] [--requests 120] [--concurrency 32]

Starts stock vLLM's OpenAI server (all plugins, the tiny Qwen4Exp, the soak's server arguments:
prefix caching, chunked prefill, a KV budget small enough to preempt, the tool and reasoning
parsers, the forced-output logits processor) and checks what tests/soak/test_soak.py checks: every
request that was not cancelled returns the tokens its canary-fresh twin returns alone, /health
answers throughout, KV blocks and state slots return to idle, each fault of tests/soak/faults.py
gets its 4xx naming the field and the server then answers a normal request as before. Writes
OUT/soak.json (the report), OUT/faults.json and OUT/server.log; prints one verdict line per check
and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.soak.driver import SoakConfig, difference, run  # noqa: E402
from tests.soak.faults import faults, send_fault  # noqa: E402
from tests.soak.test_soak import (  # noqa: E402
    BODY_TIMEOUT,
    MAX_MODEL_LEN,
    MAX_N,
    MODEL,
    SERVER_ARGS,
    _send,
    _settle,
    canary_job,
)
from tests.tool_parsers.forced_output import CLASS_PATH, CLASS_PATH_V2  # noqa: E402
from tools.vllm_server import VllmServer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="float16", help="float16 or bfloat16 on CUDA (float32 is refused there)")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--work", type=Path, default=Path("/tmp/soak_gpu"), help="where the checkpoint is built")
    args = parser.parse_args()
    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint

    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / f"tiny-{args.dtype}"  # not under OUT, whose files travel back
    if not model.exists():
        build_tiny_checkpoint(model, "qwen4_exp_text", dtype=args.dtype)
    server_args = list(SERVER_ARGS)
    server_args[server_args.index("--dtype") + 1] = args.dtype
    if torch.cuda.is_available() and os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "1") != "0":
        # vLLM's V2 runner (its default on GPUs) loads only processors of its own interface
        server_args[server_args.index(CLASS_PATH)] = CLASS_PATH_V2
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "TOOL_PARSERS_MAX_N": str(MAX_N),
        "TOOL_PARSERS_BODY_TIMEOUT_SECONDS": str(BODY_TIMEOUT),
    }
    server = VllmServer(
        model, server_args, env=env, log_path=args.out / "server.log", startup_timeout=args.start_timeout
    )
    verdicts: dict[str, bool] = {}
    server.start()
    base_url = server.base_url
    try:
        canary = canary_job()
        reference = asyncio.run(_send(base_url, canary, salt="canary-fresh"))
        idle = asyncio.run(_settle(base_url, "canary-idle"))
        report = run(SoakConfig(base_url, MODEL, requests=args.requests, concurrency=args.concurrency, seed=args.seed))
        print(report.summary(), flush=True)
        (args.out / "soak.json").write_text(json.dumps(report.to_json(), indent=1, default=str))
        verdicts["every request returns its solo tokens, /health answered, KV idle again"] = not report.problems()
        results: list[dict[str, Any]] = []
        for fault in faults(MODEL, MAX_MODEL_LEN, MAX_N):
            got = asyncio.run(send_fault(base_url, fault, BODY_TIMEOUT))
            named = all(word.lower() in got.message.lower() for word in fault.words)
            healthy = httpx.get(f"{base_url}/health", timeout=60).status_code == 200
            again = asyncio.run(_send(base_url, canary))
            ok = got.status == fault.status and named and healthy and difference(reference, again) is None
            results.append({"fault": fault.name, "status": got.status, "want": fault.status, "ok": ok,
                            "message": got.message[:300]})  # fmt: skip
        (args.out / "faults.json").write_text(json.dumps(results, indent=1))
        verdicts[f"{len(results)} faults answered, the server goes on"] = all(r["ok"] for r in results)
        for r in results:
            if not r["ok"]:
                print(f"fault {r['fault']}: status {r['status']} (want {r['want']}): {r['message']}", flush=True)
        verdicts["KV blocks and state slots idle after everything"] = asyncio.run(_settle(base_url, "final")) == idle
    finally:
        server.stop()
    for name, ok in verdicts.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}", flush=True)
    return 0 if verdicts and all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
