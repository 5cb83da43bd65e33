"""Every GPU check of csf_loader in one command, for a lent GPU machine with the kit of
../shared/docs/h200-vllm.md installed (stock vLLM 0.32 and this checkout's plugins):

    python3 benchmarks/csf_loader/gpu_session.py $OUT [--only STEPS] [--skip STEPS] [--budget 540]
        [--codecs nvfp4,mxfp4]

Steps, in this order (each in child processes with time limits, results written to OUT as they
come, so a command stopped at its limit still returns them; a step that no longer fits the
``--budget`` seconds is recorded as not run and named in the summary, to be run with ``--only``):

1. ``kernels``: what tests/csf_loader/test_csf_cuda.py checks, run as its scripts (pytest need not
   be installed): the library's Triton kernel bit-exact against the torch reference on the GPU
   (``triton_check.py``); the loader's device path (compressed streams to the GPU, checked and
   decoded there) equal to the host path, every corrupt input failing with the host path's
   message, a real out-of-memory error naming the tensor (``device_path_check.py cuda``).
2. ``serve``: a Qwen3-MoE built on the machine (``--size``: ``small`` = hidden 1024, 8 layers, 32
   experts, 768 expert scale planes; ``tiny`` = the CPU tests' model) quantized to NVFP4 (every
   decoder linear, routed experts included) and to MXFP4 (routed experts), converted to
   NVFP4-CSF and MXFP4-CSF (routed-expert scales, as published), each served by stock vLLM at
   TP=1 from the source (``--load-format auto``) and from the CSF checkpoint (``--load-format
   csf``, decoded on the GPU): every rank's parameters must be byte-identical, greedy tokens and
   top-5 logprobs identical; where they are not, the source is served again, and the CSF run may
   differ from the source no more than the source differs from itself (`compare`: stock's MoE
   kernels accumulate with atomics on some paths).
3. ``load``: benchmarks/csf_loader/load_overhead.py for each codec: load time, peak host and peak GPU
   memory of the CSF load against the source's, in one run (``--repeats`` loads of each).
4. ``tp2`` (two or more GPUs): 2. at ``tensor_parallel_size=2``.
5. ``qwen4exp``: the tiny Qwen3.8 Flash-Next (Qwen4Exp) quantized to NVFP4 with its routed experts
   (``tests/csf_loader/tiny_qwen4exp.py``), converted to NVFP4-CSF, served by the portable model
   (``QWEN38_FORCE_PORTABLE=1``: stock's Qwen4Exp needs FlashInfer, which the kit lacks) in bf16 from
   both: parameters, tokens and logprobs as in 2.
6. ``variants``: the exploration variants of benchmarks/csf_loader/decode_variants.py bit-exact on
   the GPU (``triton_check.py --variants``).
7. ``bench``: benchmarks/csf_loader/bench_decode.py (the library kernel and the sweep) into OUT.

Steps 1-4 are the proof of issue 14's item 2 and fit one device call (at most 10 minutes, the
kit's installation included) with the default budget on an H200; 5-7 usually follow in a second
call on the warm machine (``--only qwen4exp,variants,bench``, as the summary says).

``summary.json`` holds every step's verdict; ``*.log`` every child's output. The checkpoints are
built under ``--work`` (default /tmp/csf_gpu_session, reused by later calls on the same machine),
not under OUT, whose files travel back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the repository's tools package
from tools.token_compare import first_differences  # noqa: E402

SRC = [ROOT / "src" / p for p in ("csf_loader", "qwen38_plugin", "tool_parsers", "dflash2", "sm70_backend")]
STEPS = ("kernels", "serve", "load", "tp2", "qwen4exp", "variants", "bench")
CODECS = ("nvfp4", "mxfp4")
LOGPROB_TOLERANCE = 1e-3  # where a kernel is not deterministic (atomics), the largest accepted difference


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This checkout's code first on the path (the kit's plugin wheels may be older)."""
    path = os.pathsep.join([*map(str, SRC), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, VLLM_ALLOW_INSECURE_SERIALIZATION="1", PYTHONUNBUFFERED="1")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return {**env, **(extra or {})}


class Session:
    def __init__(self, out: Path, work: Path, budget: float) -> None:
        self.out, self.work, self.deadline = out, work, time.monotonic() + budget
        self.summary: dict[str, Any] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=2, default=str))

    def run(self, name: str, cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run a child with at most ``timeout`` seconds (and never past the deadline); log to OUT."""
        limit = max(1.0, min(timeout, self.left() - 5))
        start = time.time()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=limit, env=child_env(env), cwd=ROOT, check=False
            )
            status, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            status, log = 124, f"{exc.stdout}\n{exc.stderr}\ntimed out after {limit:.0f} s"
        (self.out / f"{name}.log").write_text(log)
        return {"status": status, "seconds": round(time.time() - start, 1), "log": log}


def engine(
    session: Session, tag: str, model: Path, tp: int, load_format: str, env: dict[str, str] | None = None
) -> tuple[Any, dict[str, Any]]:
    """One stock vLLM engine (tests/csf_loader/engine_run.py): its result (None if it failed) and a report."""
    out = session.out / f"engine-{tag}.json"
    cmd = [sys.executable, "tests/csf_loader/engine_run.py", str(model), str(tp), load_format, str(out), "scales=no"]
    run = session.run(f"engine-{tag}", cmd, 420, env)
    data = json.loads(out.read_text()) if run["status"] == 0 and out.exists() else None
    lines = run["log"].splitlines()
    info = {
        "status": run["status"],
        "seconds": run["seconds"],
        "backends": sorted({ln.split(" Using ", 1)[1][:120] for ln in lines if " Using " in ln and "backend" in ln}),
        "decoded": [ln.split("csf_loader: ", 1)[1] for ln in lines if "csf_loader: decoded" in ln][:2],
        "loading": [ln.split("]", 1)[-1].strip() for ln in lines if "Loading weights took" in ln][:2],
    }
    if data is None:
        info["error_tail"] = run["log"][-2500:]
    return data, info


def _first_differences(a: Any, b: Any) -> list[int | None]:
    """Per prompt, the first step whose greedy token differs between two runs (None: none)."""
    return first_differences(a["tokens"], b["tokens"])


def _aligned_difference(a: Any, b: Any) -> float:
    """Largest top-5 logprob difference over the steps where both runs saw the same tokens (up to and
    including each prompt's first differing step; after it the two continue different texts)."""
    worst = 0.0
    for sa, sb, first in zip(a["logprobs"], b["logprobs"], _first_differences(a, b), strict=True):
        for step, (x, y) in enumerate(zip(sa, sb, strict=True)):
            if first is not None and step > first:
                break
            worst = max([worst, *(abs(x[t] - y[t]) for t in set(x) & set(y))])
    return worst


def _margins_at_differences(a: Any, b: Any) -> list[float | None]:
    """Per prompt, the gap between run a's top two logprobs where the runs' tokens first differ."""
    margins: list[float | None] = []
    for steps, first in zip(a["logprobs"], _first_differences(a, b), strict=True):
        top = sorted(steps[first].values(), reverse=True) if first is not None else []
        margins.append(top[0] - top[1] if len(top) > 1 else None)
    return margins


def compare(source: Any, csf: Any, again: Any = None) -> dict[str, Any]:
    """Parameters per rank, greedy tokens, logprobs of the source run against the CSF run.

    Byte-identical parameters are required. Then either the outputs are identical, or (where
    stock's own kernels are not deterministic: ``again`` is a second run of the source) the CSF
    run differs from the source no more than the source differs from itself: logprobs within
    max(``LOGPROB_TOLERANCE``, twice the source's own spread) while the tokens agree, and every
    token difference at a near tie of the source (top-two gap within that bound)."""
    if source is None or csf is None:
        return {"ok": False, "reason": "an engine failed (see its info)"}
    params = [
        sorted(k for k in set(a) | set(b) if a.get(k, {}).get("sha256") != b.get(k, {}).get("sha256"))
        for a, b in zip(source["ranks"], csf["ranks"], strict=True)
    ]
    result: dict[str, Any] = {
        "ranks": len(csf["ranks"]),
        "parameters_identical": not any(params),
        "parameters_differing": [p[:5] for p in params],
        "tokens_identical": source["tokens"] == csf["tokens"],
        "logprobs_identical": source["logprobs"] == csf["logprobs"],
        "first_token_differences": _first_differences(source, csf),
        "max_logprob_difference_while_tokens_agree": _aligned_difference(source, csf),
    }
    identical = result["tokens_identical"] and result["logprobs_identical"]
    if identical or again is None:
        result["ok"] = bool(result["parameters_identical"] and identical)
        return result
    spread = _aligned_difference(source, again)
    bound = max(LOGPROB_TOLERANCE, 2 * spread)
    margins = _margins_at_differences(source, csf)
    result |= {
        "source_repeat_identical": source["tokens"] == again["tokens"] and source["logprobs"] == again["logprobs"],
        "source_repeat_spread": spread,
        "bound": bound,
        "source_margin_at_token_differences": margins,
    }
    result["ok"] = bool(
        result["parameters_identical"]
        and result["max_logprob_difference_while_tokens_agree"] <= bound
        and all(m is None or m <= bound for m in margins)
    )
    return result


def build_moes(session: Session, size: str) -> dict[str, Path] | None:
    """The Qwen3-MoE checkpoints (bf16, nvfp4, mxfp4) and their CSF forms, built on the machine."""
    root = session.work / f"moe-{size}"
    paths = {k: root / f"qwen3_moe_{k}" for k in ("bf16", "nvfp4", "mxfp4")}
    paths |= {"nvfp4_csf": root / "qwen3_moe_nvfp4_csf", "mxfp4_csf": root / "qwen3_moe_mxfp4_csf"}
    if all(p.exists() for p in paths.values()):
        return paths
    code = (
        "import sys, json, torch\n"
        "from pathlib import Path\n"
        "from tests.csf_loader.tiny_moe import TINY, SMALL, build_quantized_moes\n"
        "from csf_loader.convert import main as convert\n"
        f"root = Path({str(root)!r}); root.mkdir(parents=True, exist_ok=True)\n"
        f"built = build_quantized_moes(root, {{'tiny': TINY, 'small': SMALL}}[{size!r}], "
        "'cuda' if torch.cuda.is_available() else 'cpu')\n"
        "for codec in ('nvfp4', 'mxfp4'):\n"
        "    assert convert(['encode', str(built[codec]), str(root / f'qwen3_moe_{codec}_csf'), '--quiet']) == 0\n"
    )
    run = session.run(f"build-moe-{size}", [sys.executable, "-c", code], 400)
    session.summary.setdefault("build", {})[size] = {"status": run["status"], "seconds": run["seconds"]}
    if run["status"] != 0:
        session.summary["build"][size]["error_tail"] = run["log"][-2500:]
        return None
    return paths


def _source_again(
    session: Session, tag: str, model: Path, tp: int, source: Any, csf: Any, env: dict[str, str] | None = None
) -> Any:
    """A second run of the source when the CSF run's outputs are not identical to it: how far stock's
    own kernels move from run to run (atomics), the yardstick for the CSF run's difference."""
    if source is None or csf is None or (source["tokens"], source["logprobs"]) == (csf["tokens"], csf["logprobs"]):
        return None
    return engine(session, tag, model, tp, "auto", env)[0]


def serve(session: Session, paths: dict[str, Path], tp: int, codecs: Sequence[str] = CODECS) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for codec in codecs:
        source, s_info = engine(session, f"{codec}-tp{tp}-source", paths[codec], tp, "auto")
        csf, c_info = engine(session, f"{codec}-tp{tp}-csf", paths[f"{codec}_csf"], tp, "csf")
        again = _source_again(session, f"{codec}-tp{tp}-source-again", paths[codec], tp, source, csf)
        report[codec] = {"source": s_info, "csf": c_info, **compare(source, csf, again)}
        session.summary[f"serve-tp{tp}"] = report
        session.save()
        verdict = {k: v for k, v in report[codec].items() if k not in ("source", "csf")}
        print(f"serve tp{tp} {codec}: {json.dumps(verdict)}", flush=True)
    return report


def load(
    session: Session, paths: dict[str, Path], repeats: int, codecs: Sequence[str] = CODECS, read_ahead: bool = False
) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for codec in codecs:
        out = session.out / f"load-{codec}.json"
        script = "benchmarks/csf_loader/load_overhead.py"
        children = session.out / f"load-{codec}-children.log"
        cmd = [sys.executable, script, str(paths[codec]), str(paths[f"{codec}_csf"]), "--repeats", str(repeats)]
        cmd += ["--read-ahead"] if read_ahead else []
        # each load is a fresh process of about 35 s on the H100 / H200 (mostly vLLM's and CUDA's start)
        limit = 60 + 40 * repeats * (3 if read_ahead else 2)
        run = session.run(f"load-{codec}", [*cmd, "--json", str(out), "--log", str(children)], limit)
        written = json.loads(out.read_text()) if out.exists() else {}
        if written and not written.get("partial"):
            report[codec] = {k: v for k, v in written.items() if k != "samples"}
        else:
            # cut short: the loads that finished, as load_overhead.py kept them
            report[codec] = {"status": run["status"], "error_tail": run["log"][-2500:], "loads": written.get("loads")}
        session.summary["load"] = report
        session.save()
        print(run["log"][-1200:], flush=True)
    return report


def qwen4exp(session: Session) -> dict[str, Any]:
    root = session.work / "qwen4exp"
    code = (
        "from pathlib import Path\n"
        "from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint\n"
        "from tests.csf_loader.tiny_qwen4exp import quantize_qwen4exp_nvfp4\n"
        "from csf_loader.convert import main as convert\n"
        f"root = Path({str(root)!r})\n"
        "build_tiny_checkpoint(root / 'bf16', 'qwen4_exp_text')\n"
        "quantize_qwen4exp_nvfp4(root / 'bf16', root / 'nvfp4', routed_experts=True)\n"
        "assert convert(['encode', str(root / 'nvfp4'), str(root / 'nvfp4_csf'), '--quiet']) == 0\n"
    )
    if not (root / "nvfp4_csf").exists():
        built = session.run("build-qwen4exp", [sys.executable, "-c", code], 240)
        if built["status"] != 0:
            return {"ok": False, "build_error_tail": built["log"][-2500:]}
    portable = {"QWEN38_FORCE_PORTABLE": "1"}
    source, s_info = engine(session, "qwen4exp-source", root / "nvfp4", 1, "auto", portable)
    csf, c_info = engine(session, "qwen4exp-csf", root / "nvfp4_csf", 1, "csf", portable)
    again = _source_again(session, "qwen4exp-source-again", root / "nvfp4", 1, source, csf, portable)
    return {"source": s_info, "csf": c_info, **compare(source, csf, again)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of {STEPS}")
    parser.add_argument("--skip", default="")
    parser.add_argument(
        "--codecs", default=",".join(CODECS), help="the codecs of the serve, tp2 and load steps (a call may fit one)"
    )
    parser.add_argument("--size", choices=["small", "tiny"], default="small")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole session")
    parser.add_argument(
        "--repeats", type=int, default=3, help="loads of each checkpoint in the load step (the first compiles)"
    )
    parser.add_argument(
        "--read-ahead",
        action="store_true",
        help="the load step also loads each CSF checkpoint with its stream on a thread ahead (load_overhead.py "
        "--read-ahead)",
    )
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/csf_gpu_session"), help="checkpoints (kept out of OUT: gigabytes)"
    )
    args = parser.parse_args()
    steps = [s for s in args.only.split(",") if s and s not in set(args.skip.split(","))]
    unknown = set(steps) - set(STEPS)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; use {STEPS}")
    codecs = [c for c in args.codecs.split(",") if c]
    if not codecs or set(codecs) - set(CODECS):
        parser.error(f"--codecs {args.codecs!r}: use a comma-separated subset of {CODECS}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    session = Session(args.out, args.work, args.budget)
    import torch

    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name() if gpus else None
    session.summary["machine"] = {"gpus": gpus, "name": name, "torch": torch.__version__}
    minimum = {"kernels": 40, "serve": 150, "load": 60, "tp2": 120, "qwen4exp": 60, "variants": 40, "bench": 120}
    not_run: list[str] = []
    paths: dict[str, Path] | None = None
    for step in sorted(steps, key=STEPS.index):
        if step == "tp2" and gpus < 2:
            session.summary["tp2"] = "not run: one GPU (use the nvidia-h200-x2 kind)"
            continue
        if session.left() < minimum[step]:
            not_run.append(step)
            continue
        if step == "kernels":
            checks = {
                "library": ["tests/csf_loader/triton_check.py"],
                "device_path": ["tests/csf_loader/device_path_check.py", "cuda"],
            }
            report = {}
            for check, script in checks.items():
                run = session.run(f"kernels-{check}", [sys.executable, *script], 240)
                report[check] = {"status": run["status"], "seconds": run["seconds"], "tail": run["log"][-600:]}
            session.summary["kernels"] = report
        elif step == "variants":
            run = session.run("variants", [sys.executable, "tests/csf_loader/triton_check.py", "--variants"], 240)
            session.summary["variants"] = {k: run[k] for k in ("status", "seconds")} | {"tail": run["log"][-600:]}
        elif step == "bench":
            script = "benchmarks/csf_loader/bench_decode.py"
            run = session.run("bench", [sys.executable, script, "--json", str(args.out / "bench_decode.json")], 600)
            session.summary["bench"] = {"status": run["status"], "tail": run["log"][-3000:]}
        elif step == "qwen4exp":
            session.summary["qwen4exp"] = qwen4exp(session)
        else:
            paths = paths or build_moes(session, args.size)
            if paths is None:
                session.summary[step] = "not run: the checkpoints were not built (see build)"
            elif step == "serve":
                serve(session, paths, 1, codecs)
            elif step == "tp2":
                serve(session, paths, 2, codecs)
            else:
                session.summary["load"] = load(session, paths, args.repeats, codecs, args.read_ahead)
        session.save()
        print(f"{step}: done, {session.left():.0f} s left", flush=True)
    if not_run:
        session.summary["not_run"] = {"steps": not_run, "rerun": f"--only {','.join(not_run)}"}
    session.save()
    print(json.dumps({k: v for k, v in session.summary.items() if k != "kernels"}, indent=1, default=str)[-6000:])


if __name__ == "__main__":
    main()
