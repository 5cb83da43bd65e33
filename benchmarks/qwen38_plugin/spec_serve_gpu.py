"""Issue 12 item 5 on a GPU: MTP and DFlash through stock vLLM's OpenAI server, against the same server
without speculation, greedy and sampled, with /metrics.

    python benchmarks/qwen38_plugin/spec_serve_gpu.py OUT [--servers plain,mtp,dflash] [--tp 1]
    python benchmarks/qwen38_plugin/spec_serve_gpu.py OUT --device cpu      # a dry run on CPU (fp32)

The workload of the CPU test ``tests/qwen38_plugin/test_qwen38_mtp_server.py`` (its two-token Qwen4Exp
checkpoint with an MTP head, 4 completions and 3 chats of 24 greedy tokens sent together, 512 samples of
5 tokens at temperature 1 restricted to the two tokens, /metrics), served one server after another on
the machine's device in fp16 (CUDA has no float32 GDN prefill) with vLLM's defaults there (the V2
runner, CUDA graphs):

* ``plain``: no speculation, the reference on the same GPU and dtype;
* ``mtp``: the checkpoint's MTP head, 3 drafts, with dflash2's concurrency ladder (``LADDER``);
* ``dflash``: dflash2's tiny random drafter through a ``dflash2-view`` with ``hc_mean``, 3 drafts
  (``--tp 2`` on a two-GPU machine: the target and the drafter's column-parallel ``fc`` split).

Reported per server (OUT/spec_serve.json) and checked:

* greedy: each request's tokens against ``plain``'s and against transformers' fp32 greedy decoding;
  where they differ, the first position and transformers' margin there (top-1 minus top-2 logit), so
  a difference at a near tie (fp16 rounding in another batch shape) is told from a wrong token;
* sampling: Pearson's chi-square of the 512 sampled sequences against their exact probabilities
  (transformers, fp32) at the test's ``ALPHA`` = 1e-3, for ``plain`` too (the fp16 target's own
  distance from the fp32 probabilities);
* /metrics: drafts, draft tokens and accepted tokens per position consistent, acceptance above 0
  (above 0.3 for MTP, whose head is the target's own layer here), the ladder's narrower verify steps
  and its log line.

The verdict line is ``spec_serve ok`` only when every speculative server's greedy tokens equal
``plain``'s (or differ only where transformers' margin is below ``--tie``), every chi-square is below
its threshold and every /metrics check holds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the repository's tests and tools packages


def margin_at(hf: Any, prompt: list[int], tokens: list[int], at: int) -> float:
    """transformers' top-1 minus top-2 logit before ``tokens[at]`` (after the prompt and tokens[:at])."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens[:at]])).logits[0, -1].double()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--servers", default="plain,mtp,dflash")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the dflash server")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run in fp32")
    parser.add_argument("--tie", type=float, default=0.05, help="a greedy difference at a margin below this is a tie")
    parser.add_argument("--startup-timeout", type=float, default=420.0)
    args = parser.parse_args()
    import torch

    from dflash2.tiny import build_tiny_drafter
    from dflash2.view import make_view
    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint
    from tests.qwen38_plugin import test_qwen38_mtp_server as spec_test
    from tests.qwen38_plugin.qwen38_reference import load_reference, reference_greedy_one
    from tests.qwen38_plugin.test_qwen38_spec_verify_engine import MTP, two_token_checkpoint
    from tools.token_compare import first_difference
    from tools.vllm_server import VllmServer

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu for the dry run)")
    dtype = "float16" if cuda else "float32"
    # a time limit's SIGTERM unwinds through the servers' stop (each in its own session)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    source = build_tiny_checkpoint(work / "source", "qwen4_exp_text", dtype=dtype, overrides=MTP, overwrite=True)
    model = two_token_checkpoint(source, work / "model", scale=spec_test.SCALE)
    view = make_view(build_tiny_drafter(work / "dflash", model, overwrite=True), work / "view",
                     max_position_embeddings=512).path  # fmt: skip
    dflash = {"method": "dflash", "model": str(view), "num_speculative_tokens": spec_test.NUM_SPEC}
    configs: dict[str, list[str]] = {
        "plain": [],
        "mtp": spec_test.CONFIGS["mtp"],
        "dflash": ["--speculative-config", json.dumps(dflash), "--tensor-parallel-size", str(args.tp)],
    }
    names = [n for n in args.servers.split(",") if n]
    unknown = set(names) - set(configs)
    if unknown:
        parser.error(f"--servers: unknown {sorted(unknown)}; of {sorted(configs)}")

    logs = iter(args.out / f"server-{i}.log" for i in itertools.count())

    def start_server(path: Path, server_args: list[str]) -> VllmServer:
        return VllmServer(path, server_args, log_path=next(logs), startup_timeout=args.startup_timeout).start()

    # the test's servers and workload in this run's dtype; on CPU each server holds a core per rank
    results = spec_test.Results(model, start_server, configs, dtype=dtype, hold_cores=not cuda)
    hf = load_reference(model, torch.float32)
    probs = spec_test.exact_probabilities(model, spec_test.SAMPLE_PROMPT)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": dtype,
                              "tp_dflash": args.tp, "servers": {}}  # fmt: skip
    reference: dict[tuple[int, ...], list[int]] = {}

    def transformers_greedy(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in reference:
            with torch.no_grad():
                reference[tuple(prompt)] = reference_greedy_one(hf, prompt, spec_test.STEPS)[0]
        return reference[tuple(prompt)]

    def compare(served: list[tuple[list[int], list[int]]], expected_tokens: list[list[int]]) -> list[dict[str, Any]]:
        rows = []
        for (prompt, tokens), expected in zip(served, expected_tokens, strict=True):
            at = first_difference(tokens, expected)
            row: dict[str, Any] = {"equal": at is None}
            if at is not None:
                row.update(first_difference=at, margin=margin_at(hf, prompt, expected, at))
            rows.append(row)
        return rows

    ok = True
    plain_greedy: list[tuple[list[int], list[int]]] | None = None
    for name in names:
        try:
            served = results(name)
        except Exception as exc:  # a server that fails to start is reported, the others still run
            report["servers"][name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[-3000:]}"}
            ok = False
            print(f"spec_serve {name}: failed: {str(exc)[-600:]}", flush=True)
            (args.out / "spec_serve.json").write_text(json.dumps(report, indent=2))
            continue
        entry: dict[str, Any] = {}
        entry["vs_transformers"] = compare(served["greedy"], [transformers_greedy(p) for p, _ in served["greedy"]])
        if name == "plain":
            plain_greedy = served["greedy"]
        elif plain_greedy is not None:
            entry["vs_plain"] = compare(served["greedy"], [tokens for _, tokens in plain_greedy])
            wrong = [r for r in entry["vs_plain"] if not r["equal"] and r["margin"] >= args.tie]
            entry["greedy_ok"] = not wrong
            ok &= not wrong
        statistic, df = spec_test.pearson(Counter(served["samples"]), probs)
        threshold = spec_test.chi2_quantile(spec_test.ALPHA, df)
        entry["chi_square"] = {"statistic": statistic, "df": df, "threshold": threshold,
                               "p": spec_test.chi2_sf(statistic, df), "ok": statistic < threshold}  # fmt: skip
        ok &= statistic < threshold
        if name != "plain":
            entry["metrics"] = spec_test.metrics_checks(name, served["metrics"], served["log"])
            entry["metrics"]["ok"] = all(entry["metrics"]["checks"].values())
            ok &= entry["metrics"]["ok"]
        report["servers"][name] = entry
        (args.out / "spec_serve.json").write_text(json.dumps(report, indent=2))
        summary = {k: v for k, v in entry.items() if k not in ("vs_transformers", "vs_plain")}
        summary["greedy_equal_transformers"] = sum(r["equal"] for r in entry["vs_transformers"])
        if "vs_plain" in entry:
            summary["greedy_equal_plain"] = sum(r["equal"] for r in entry["vs_plain"])
        if "metrics" in summary:
            summary["metrics"] = {k: summary["metrics"][k] for k in ("acceptance", "per_position", "ok")}
        print(f"spec_serve {name}: {json.dumps(summary)}", flush=True)
    if plain_greedy is None and len(names) > 1:
        ok = False
    report["ok"] = ok
    (args.out / "spec_serve.json").write_text(json.dumps(report, indent=2))
    print(f"spec_serve {'ok' if ok else 'NOT ok'} ({report['device']}, {dtype})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
