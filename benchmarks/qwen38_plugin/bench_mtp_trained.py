"""Issue 12 item 6: train the checkpoint's MTP head and a DFlash drafter on text the target
generates, then measure both inside stock vLLM against no speculation, in one run (one table).

    python benchmarks/qwen38_plugin/bench_mtp_trained.py OUT_DIR [--config medium] [--dtype float16]
        [--sequences 256] [--new-tokens 192] [--train-steps 400] [--drafts 1,3] [--batches 1,4,8,64]
        [--no-untrained] [--methods mtp,dflash] [--dflash-drafts 3] [--dflash-layers 1]
        [--dflash-train-seconds 140] [--dflash-lr 1e-3] [--dflash-batch 8] [--dflash-blocks 16]
    python benchmarks/qwen38_plugin/bench_mtp_trained.py OUT_DIR --dry-run     # the same on CPU, tiny
        (--dry-run sets CPU sizes for every option not given: `--dry-run --pretrain-steps 400
        --train-steps 300` trains for real on the CPU)

0. ``pretrain`` (``--pretrain-steps`` N > 0; this process, transformers' ``Qwen4ExpForCausalLM`` on
   the GPU, bf16 autocast): the random checkpoint of ``--config`` is trained as a causal LM (AdamW,
   N steps or ``--pretrain-seconds``, whichever ends first; warm-up, then cosine) on the Python
   standard library's own source (every ``.py`` file under ``sysconfig``'s stdlib path, sorted,
   read with the checkpoint's real Qwen3.6 tokenizer, at most ``--corpus-tokens`` tokens; its
   last tenth held out), so that the target's text has structure a drafter can learn: a random
   target's greedy text has none (2026-12-02 on the H200: held-out loss near ln(vocab) after
   training the head). The trained weights replace the source's in a copy of the checkpoint, its
   ``mtp.*`` head kept (written beside and renamed into place). The prompts below are then
   16-token windows of the held-out corpus, else random token ids.
1. ``generate`` (a vLLM child, no speculation): the target (with an MTP head,
   ``mtp_num_hidden_layers`` 1) greedily continues ``--sequences`` prompts of 16 tokens by
   ``--new-tokens`` tokens: the target's own text (eager, every sequence at once: training data,
   not a measurement).
2. ``train`` (this process, plain torch on the GPU): the target's residual streams before its final
   mixer come from transformers' Qwen4Exp in fp32, 64 sequences a forward (`hf_streams`, no
   gradient), the first two checked against the plain-torch oracle
   (`qwen38_plugin.model.Qwen4ExpCore.forward_streams`, `oracle_gap`: the report's ``oracle_gap``,
   beside the gap to the layer before, which must be twice as large at least),
   which runs each sequence alone and took 77-84 s for 128 of them on the H200; the head
   (`qwen38_plugin.mtp_reference.Qwen4ExpMTPReference`, stock's semantics, the target's embedding
   and lm_head frozen) is trained teacher-forced to predict token p + 2 from
   the streams at p and token p + 1 (cross entropy, AdamW), one sequence per step; the loss and the
   head's top-1 agreement with the target on held-out sequences are printed before and after.
   With ``--chain-train N`` the loss also covers chained drafts 2 .. N (each reading the previous
   draft's output streams, as vLLM's proposer runs them; `head_loss`). After training, the
   reference's acceptance length for the head's chained drafts at random places in the held-out
   text. The trained ``mtp.*`` tensors go into a copy of the checkpoint
   under their on-disk names.
   Skipped without ``mtp`` in ``--methods``.
3. ``dflash-train`` (this process, plain torch on the GPU; without ``dflash`` in ``--methods``,
   skipped): a DFlash drafter for the target (`dflash_config_for`: ``--dflash-layers`` causal Qwen3
   layers at the target's width, ``target_layer_ids`` the target's first, middle and last layers,
   ``hc_mean``, mask token ``<|fim_pad|>``, block ``--dflash-drafts`` + 1) is trained in
   `dflash2.drafter_reference` (stock vLLM's ``DFlashQwen3ForCausalLM`` in plain torch; the test
   tests/dflash2/test_drafter_reference.py holds it to vLLM's drafts). The target's features (the
   ``hc_mean`` of its residual streams after those layers) come from transformers, checked against the
   oracle, as in stage 2; the target's embedding and lm_head are shared and frozen. Teacher-forced:
   each step takes ``--dflash-batch`` sequences and ``--dflash-blocks`` random anchors in each one's
   generated text; block = the anchor's token and mask tokens after it, seeing the features before the
   anchor; every block of a sequence runs in one forward under one attention mask; cross entropy on the
   drafts (draft k weighted 0.8 ** (k - 1)), AdamW, warm-up then cosine, bf16 autocast on CUDA, until
   ``--dflash-train-steps`` or ``--dflash-train-seconds``. Before, after and every tenth of the run:
   held-out loss, top-1 agreement with the target per draft position over every anchor of the held-out
   sequences, and the acceptance length greedy verification would give there (1 + the mean run of
   correct leading drafts): the reference's prediction of what vLLM measures. The drafter kept is the
   one with the longest such prediction (early stopping: the drafter overfits a few hundred sequences;
   the report's ``history`` and ``kept_step``). The drafter directory (config.json, model.safetensors,
   train_report.json) is written beside and renamed into place.
   With ``--dflash-draft-vocab N`` the drafter drafts from the ``N`` tokens most frequent in its
   training sequences' generated text (ties by id) through its own lm_head (the target's rows for
   them, frozen) and stock's ``d2t`` map (``draft_vocab_size`` N): its logits cost a GEMV over N
   rows instead of the whole vocabulary (0.18 ms of a 2.9 ms DFlash step at batch 1 on the medium
   config, 2026-12-06 part l). A label outside them counts as a wrong draft in the evaluations and
   is left out of the loss; the report's ``draft_vocab`` gives N and how much of the held-out text
   they cover.
4. ``measure`` (a vLLM child per setting, vLLM's defaults but prefix caching, which is off for every
   setting: V2 runner and CUDA graphs on a GPU): on prompts the training never saw (one list; each
   batch size serves at least ``--min-sequences`` of them, in groups of the batch size one after
   another, so concurrency 1 is not one sequence's luck), decode tokens/s at each batch
   size (concurrency) without speculation, with MTP at each ``--drafts`` count (the head before and
   after training) and with the trained DFlash drafter (``dflash{K}-trained``, ``--dflash-drafts`` K;
   the portable model refuses DFlash beside prefix caching, so all settings run without it and the
   ratios compare speculation alone); the acceptance length (1 + accepted drafts per verify step, from vLLM's
   spec-decode counters; also the share of verify steps that kept each draft position) and the
   speed-up against no speculation, and how many sequences came out token for token as plain's
   (greedy speculation keeps the target's tokens; fp16 ties aside). Targets (issue 12): acceptance
   length >= 2.5 and >= 1.8x at concurrency 1.

Each stage's result is kept under ``--work`` (the pretrained and the head-trained checkpoints, the
generated text, each setting's measurement), and a later run with the same arguments on the same
machine skips what is there, so the stages can be spread over several device calls
(``--stop-after pretrain|generate|train|dflash-train``; a measure call cut short keeps the settings
it finished, and the next call with the same arguments measures the rest and prints the whole table).
``--rounds N`` measures every setting N times, round after round, each in a new process, and keeps
each batch size's fastest round (the table shows every round's tok/s): the host's speed moves
between processes and over minutes, so one process per setting gave speed-ups that moved by up to
2x between sessions at the same acceptance.

Results: OUT_DIR/bench_mtp_trained.json and a table. ``--dry-run`` proves the script on CPU (the
tiny config in float32, a few sequences and steps, batches 1 and 2; vLLM's CPU runner wants prefix
caching off with speculation; the DFlash drafter gets one layer there, since vLLM's V1 runner, the
CPU's, wants all drafter layers in one KV-cache group, which a hybrid target's grouping gives only
one layer; the V2 runner takes several): its numbers are not measurements.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "qwen38_plugin"))

from batched_qsa_indexer import batched_qsa_indexer  # noqa: E402  (transformers' QSA indexer without its loop)
from bench_cpu import CONFIGS  # noqa: E402  (the model geometries of the CPU and GPU benchmarks)
from bench_gpu import CAPTURE_SIZES_HELP, capture_sizes, finish_child, timed_greedy  # noqa: E402  (shared with bench_gpu)

PROMPT_LEN = 16
MTP = {"mtp_num_hidden_layers": 1}


def build_checkpoint(work: Path, config: str, dtype: str) -> Path:
    from qwen38_plugin.tiny.checkpoints import build_tiny_checkpoint

    path = work / f"ckpt-{config}-{dtype}-mtp"
    if not path.exists():
        build_tiny_checkpoint(path, "qwen4_exp_text", overrides={**CONFIGS[config], **MTP}, dtype=dtype)
    return path


def random_prompts(n: int, seed: int, corpus: str | None = None) -> list[list[int]]:
    """``n`` prompts of ``PROMPT_LEN`` tokens: windows of the held-out corpus at random offsets when
    ``corpus`` (a token file of `corpus_tokens`) is given, else random token ids."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if corpus:
        held_out = held_out_tokens(corpus)
        starts = torch.randint(0, held_out.numel() - PROMPT_LEN, (n,), generator=gen).tolist()
        return [held_out[s : s + PROMPT_LEN].tolist() for s in starts]
    return [torch.randint(0, 240_000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(n)]


@functools.cache
def held_out_tokens(corpus: str) -> Any:
    """The held-out tokens of a `corpus_tokens` file (read once per process)."""
    import torch

    return torch.load(corpus)[-1]


# ---------------------------------------------------------------------------------------------
# Pretraining the target (stage 0)
# ---------------------------------------------------------------------------------------------


def corpus_tokens(work: Path, tokenizer_dir: Path, max_tokens: int) -> Path:
    """The Python standard library's source as token ids (train, held out): a tensor pair in a
    file under ``work``, made once."""
    import sysconfig

    import torch
    from tokenizers import Tokenizer

    path = work / f"corpus-stdlib-{max_tokens}.pt"
    if path.exists():
        return path
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    if eos is None:
        raise RuntimeError(f"corpus_tokens: {tokenizer_dir} has no <|endoftext|> token")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    ids: list[int] = []
    for start in range(0, len(files), 64):
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files[start : start + 64]]
        for encoding in tokenizer.encode_batch(texts):
            ids.extend([*encoding.ids, eos])
        if len(ids) >= max_tokens:
            break
    tokens = torch.tensor(ids[:max_tokens], dtype=torch.int64)
    cut = tokens.numel() - tokens.numel() // 10
    staging = path.with_suffix(".partial")
    torch.save((tokens[:cut].clone(), tokens[cut:].clone()), staging)
    staging.rename(path)
    return path


WARMUP = 0.05  # of a training run (stages 0 and 3), then cosine down to a tenth


def run_fraction(step: int, max_steps: int, elapsed: float, max_seconds: float) -> float:
    """How far a run is that ends at ``max_steps`` or ``max_seconds`` (0: no limit), whichever comes
    first: the schedule follows whichever is nearer its end, so a time-bounded run still anneals."""
    return max(step / max_steps, elapsed / (max_seconds or float("inf")))


def warmup_cosine(done: float) -> float:
    """The learning rate's scale at fraction ``done`` of a run: linear warm-up, then cosine to 0.1."""
    import math

    if done < WARMUP:
        return max(done / WARMUP, 0.01)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (done - WARMUP) / (1 - WARMUP))))


def training_autocast(device: str) -> Any:
    """bf16 autocast on CUDA; on CPU none (the dry run trains in fp32)."""
    import torch

    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)


def pretrain(args: argparse.Namespace, model: Path, corpus: Path, device: str) -> tuple[Path, dict[str, Any]]:
    """Stage 0: the target trained as a causal LM on the corpus; its checkpoint and report."""
    import torch

    # every setting that changes the result is in the name, so a later run reuses only its own result
    destination = args.work / (
        f"{model.name}-pretrained-{args.pretrain_steps}-{args.pretrain_seconds}s-lr{args.pretrain_lr}"
        f"-{args.pretrain_batch}x{args.pretrain_seq_len}-{corpus.stem}"
    )
    report_file = destination / "pretrain_report.json"
    if report_file.exists():
        return destination, json.loads(report_file.read_text())
    train_ids, held_out = torch.load(corpus)
    with reference_gated_delta_rule(device), batched_qsa_indexer():
        return _pretrain(args, model, train_ids, held_out, device, destination)


@contextlib.contextmanager
def reference_gated_delta_rule(device: str) -> Iterator[None]:
    """transformers' Qwen4Exp with its own torch chunked Gated DeltaNet instead of fla's on a GPU.

    fla's chunked GDN backward refuses Triton 3.4-3.7.0 on Hopper (wrong gradients there, fla issue
    640), and the H200's image has Triton 3.6; the forward is fine, training is not. transformers
    binds fla's function when its modeling module is imported, so the module global is swapped for
    the torch function it wraps for the length of the training, then put back."""
    import transformers.models.qwen4_exp.modeling_qwen4_exp as hf_qwen4

    name = "torch_chunk_gated_delta_rule"
    bound = getattr(hf_qwen4, name)
    if device == "cuda":
        setattr(hf_qwen4, name, inspect.unwrap(bound))
    try:
        yield
    finally:
        setattr(hf_qwen4, name, bound)


def _pretrain(
    args: argparse.Namespace, model: Path, train_ids: Any, held_out: Any, device: str, destination: Path
) -> tuple[Path, dict[str, Any]]:
    import torch
    from transformers import Qwen4ExpForCausalLM

    net = Qwen4ExpForCausalLM.from_pretrained(str(model), dtype=torch.float32).to(device).train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.pretrain_lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    length, batch = args.pretrain_seq_len, args.pretrain_batch
    autocast = training_autocast(device)

    def windows(tokens: Any, n: int) -> Any:
        starts = torch.randint(0, tokens.numel() - length, (n,), generator=gen)
        return torch.stack([tokens[s : s + length] for s in starts.tolist()]).to(device)

    def held_out_loss() -> float:
        net.eval()
        with torch.no_grad(), autocast:
            losses = [
                float(net(input_ids=(w := windows(held_out, batch)), labels=w, use_cache=False).loss) for _ in range(4)
            ]
        net.train()
        return sum(losses) / len(losses)

    report: dict[str, Any] = {"corpus_train_tokens": train_ids.numel(), "corpus_held_out_tokens": held_out.numel(),
                              "max_steps": args.pretrain_steps, "max_seconds": args.pretrain_seconds,
                              "batch": batch, "seq_len": length,
                              "lr": args.pretrain_lr, "held_out_loss_before": held_out_loss()}  # fmt: skip
    print(f"pretrain: held-out loss before {report['held_out_loss_before']:.3f}", flush=True)
    start = time.perf_counter()
    step, printed = 0, 0.0
    while (done := run_fraction(step, args.pretrain_steps, time.perf_counter() - start, args.pretrain_seconds)) < 1.0:
        for group in optimizer.param_groups:
            group["lr"] = args.pretrain_lr * warmup_cosine(done)
        ids = windows(train_ids, batch)
        with autocast:
            loss = net(input_ids=ids, labels=ids, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        step += 1
        if done - printed >= 0.1:
            printed = done
            print(f"pretrain: step {step} ({done:.0%} of the run) loss {loss.item():.3f}", flush=True)
    report["steps_run"] = step
    report["train_s"] = round(time.perf_counter() - start, 1)
    report["held_out_loss_after"] = held_out_loss()
    print(f"pretrain: held-out loss after {report['held_out_loss_after']:.3f} ({report['train_s']} s)", flush=True)
    write_pretrained(model, net, destination, report)
    return destination, report


def write_pretrained(source: Path, net: Any, destination: Path, report: dict[str, Any]) -> None:
    """A copy of ``source`` with ``net``'s weights in the source's dtype, the source's ``mtp.*``
    head, config, tokenizer and chat template kept; written beside, then renamed into place."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    staging = destination.with_name(destination.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    saved = staging / "saved"
    source_dtype = json.loads((source / "config.json").read_text()).get("dtype", "float16")
    net.to(getattr(torch, source_dtype)).save_pretrained(saved, safe_serialization=True)
    mtp = {}
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names = list(f.keys())
            mtp.update({name: f.get_tensor(name) for name in names if name.startswith("mtp.")})
    files = sorted(saved.glob("*.safetensors"))
    if len(files) != 1:
        raise RuntimeError(f"write_pretrained: expected one safetensors shard, got {[f.name for f in files]}")
    tensors = load_file(files[0])
    save_file({**tensors, **mtp}, str(staging / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(saved)
    (staging / "pretrain_report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(destination, ignore_errors=True)
    staging.rename(destination)


# ---------------------------------------------------------------------------------------------
# vLLM children
# ---------------------------------------------------------------------------------------------


def engine_kwargs(args: argparse.Namespace, drafts: int) -> dict[str, Any]:
    """vLLM's arguments; with ``drafts``, MTP speculation, or DFlash with ``args.drafter``."""
    kwargs: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "seed": 0, "skip_tokenizer_init": True,
        "max_model_len": PROMPT_LEN + args.new_tokens + 16, "max_num_seqs": max(args.batches),
    }  # fmt: skip
    # Prefix caching off for every setting: the portable model refuses DFlash beside it (its QSA
    # block keys would get no hits), vLLM's CPU runner wants it off with speculation, and it costs
    # this model's host side per KV-cache group, so plain and MTP with it on would be slowed
    # against DFlash by a cost that has nothing to do with speculation (the prompts share nothing).
    kwargs["enable_prefix_caching"] = False
    if not args.cpu:
        kwargs["gpu_memory_utilization"] = 0.5
        sizes = capture_sizes(args.capture_sizes, args.batches, 1 + drafts)
        if sizes is not None:
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    if drafts and args.drafter:
        kwargs["speculative_config"] = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": drafts}
    elif drafts:
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": drafts}
    return kwargs


def child_generate(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # Training text, not a measurement: every sequence at once and eager (no compile, no graph capture).
    # With the measured settings (max_num_seqs = the largest measured batch, 1 for --batches 1, and
    # CUDA graphs) the sequences went one at a time behind a compiling, graph-capturing start: 212 s
    # on a cold H200 (2026-12-03), 160 s of it the start.
    kwargs = engine_kwargs(args, 0)
    kwargs.pop("compilation_config", None)
    kwargs.update(max_num_seqs=max(1, min(args.sequences, 256)), enforce_eager=True)
    llm = LLM(**kwargs)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in random_prompts(args.sequences, 1, args.corpus)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return {"sequences": [list(o.prompt_token_ids or []) + list(o.outputs[0].token_ids) for o in outputs]}


def spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's spec-decode counters, and the accepted drafts by draft position (a list)."""
    from vllm.v1.metrics.reader import Counter, Vector

    counters: dict[str, Any] = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode_num"):
            continue
        if isinstance(m, Counter):
            counters[m.name.removeprefix("vllm:")] = m.value
        elif isinstance(m, Vector):
            counters[m.name.removeprefix("vllm:")] = list(m.values)
    return counters


def measured_groups(batch: int, min_sequences: int) -> int:
    """How many groups of ``batch`` concurrent requests one batch size's measurement serves, one
    group after another: enough for ``min_sequences`` sequences, so a small batch's acceptance is
    not one sequence's (2026-12-04: concurrency 1 on one prompt accepted 1.48 where concurrency 4
    and 8 accepted 2.84 and 3.22)."""
    return max(1, -(-min_sequences // batch))


def acceptance_length(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """1 + accepted drafts per verify step between two `spec_counters` readings (None: no drafts)."""
    drafts = after.get("spec_decode_num_drafts", 0) - before.get("spec_decode_num_drafts", 0)
    if not drafts:
        return None
    return 1 + (after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]) / drafts


def child_measure(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs(args, args.drafts), disable_log_stats=False)
    # one prompt list for every batch size (a prefix of it each), so the batch sizes and the
    # settings decode the same text and their greedy tokens can be set side by side
    most = max(b * measured_groups(b, args.min_sequences) for b in args.batches)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in random_prompts(most, 1000, args.corpus)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    results: dict[str, Any] = {}
    for batch in args.batches:
        groups = [prompts[g * batch : (g + 1) * batch] for g in range(measured_groups(batch, args.min_sequences))]
        prefill = total = 0.0
        tokens: list[list[int]] = []
        by_group: list[float] = []
        before = spec_counters(llm)
        for group in groups:
            timed_greedy(llm, group, 4)  # warm-up at this batch size, both run lengths
            timed_greedy(llm, group, 1)
            prefill += min(timed_greedy(llm, group, 1) for _ in range(args.repeats))
            start = spec_counters(llm)
            runs = []
            for _ in range(args.repeats):  # (timed_greedy's run, keeping the tokens)
                began = time.perf_counter()
                outputs = llm.generate(group, params, use_tqdm=False)
                runs.append(time.perf_counter() - began)
            total += min(runs)
            tokens += [list(o.outputs[0].token_ids) for o in outputs]
            if (group_length := acceptance_length(start, spec_counters(llm))) is not None:
                by_group.append(group_length)
        after = spec_counters(llm)
        row: dict[str, Any] = {"sequences": len(tokens), "prefill_s": prefill, "total_s": total, "tokens": tokens}
        if total > prefill:
            row["decode_tok_s"] = len(tokens) * (args.new_tokens - 1) / (total - prefill)
        else:
            # (2026-12-02, plain at batch 64: the 1-token runs were the slower ones, a compile among them)
            row["error"] = (f"decode time not measurable: {args.new_tokens} tokens took {total:.3f} s, no more "
                            f"than the {prefill:.3f} s of a 1-token run")  # fmt: skip
        if (length := acceptance_length(before, after)) is not None:
            drafts = after["spec_decode_num_drafts"] - before.get("spec_decode_num_drafts", 0)
            row["acceptance_length"] = length
            row["acceptance_by_group"] = by_group
            row["verify_steps"] = drafts / args.repeats
            by_position = after.get("spec_decode_num_accepted_tokens_per_pos")
            if by_position is not None:
                earlier = before.get("spec_decode_num_accepted_tokens_per_pos") or [0] * len(by_position)
                # the share of verify steps that accepted draft k (vLLM counts a draft only after all before it)
                row["accepted_by_position"] = [(a - b) / drafts for a, b in zip(by_position, earlier, strict=True)]
        results[str(batch)] = row
        print("RESULT " + json.dumps(results), flush=True)
    return results


def run_child(kind: str, args: argparse.Namespace, model: Path, tag: str, timeout: int, **extra: Any) -> dict[str, Any]:
    """A child process (``--child kind``); its last RESULT line, or the error."""
    cmd = [sys.executable, __file__, str(args.out), "--child", kind, "--model", str(model), "--dtype", args.dtype,
           "--batches", ",".join(map(str, args.batches)), "--new-tokens", str(args.new_tokens),
           "--sequences", str(args.sequences), "--repeats", str(args.repeats),
           "--min-sequences", str(args.min_sequences), "--drafts-one", str(extra.get("drafts", 0)),
           "--capture-sizes", args.capture_sizes]  # fmt: skip
    if extra.get("drafter"):
        cmd += ["--drafter", str(extra["drafter"])]
    if args.cpu:
        cmd.append("--cpu")
    if args.corpus:
        cmd += ["--corpus", args.corpus]
    env = {**os.environ, **({"VLLM_CPU_KVCACHE_SPACE": "2"} if args.cpu else {})}
    log = args.out / f"child-{tag}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
    return finish_child((proc, log), timeout)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def load_oracle(model: Path, device: str, with_head: bool = True) -> tuple[Any, Any]:
    """The plain-torch target (eval) and, ``with_head``, its MTP head (else None), in fp32."""
    import torch
    from transformers import AutoConfig

    from qwen38_plugin.model import Qwen4ExpCore, iter_safetensors
    from qwen38_plugin.mtp_reference import Qwen4ExpMTPReference

    config = AutoConfig.from_pretrained(model)
    core = Qwen4ExpCore(config)
    tensors = list(iter_safetensors(model))
    core.load_checkpoint_tensors(tensors)
    head = None
    if with_head:
        head = Qwen4ExpMTPReference(config)
        head.load_checkpoint_tensors(tensors)
        head = head.to(device=device, dtype=torch.float32)
    # fp32 masters for training (the served checkpoint keeps its dtype)
    return core.to(device=device, dtype=torch.float32).eval(), head


def target_streams(core: Any, sequences: list[list[int]], device: str, layers: list[int] | None = None) -> list[Any]:
    """The plain-torch oracle's streams, each sequence alone (no gradient): before its final mixer
    at every position, or with ``layers``, a dict of the streams entering each of those layers
    (``num_hidden_layers``: after the last), as `hf_streams` gives them."""
    import torch

    from qwen38_plugin.model import DictStateStore, SequenceCache

    out: list[Any] = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor(seq, device=device)
            positions = torch.arange(len(seq), device=device)
            store = DictStateStore(core, [SequenceCache()])
            entering: dict[int, Any] = dict.fromkeys(layers or [])
            _, streams = core.forward_streams(ids, positions, [len(seq)], store, entering if layers else None)
            out.append({i: t for i, t in entering.items() if t is not None} if layers else streams)
    return out


def hf_streams(
    model: Path, sequences: list[list[int]], indices: list[int], device: str, batch: int = 64
) -> list[dict[int, Any]]:
    """For each sequence, the residual streams ``[T, hc * H]`` entering each layer in ``indices``
    (``num_hidden_layers``: the final mixer's input), from transformers' Qwen4Exp in fp32, ``batch``
    equal-length sequences a forward (no gradient).

    The same streams as the plain-torch oracle's (`target_streams`, `qwen4exp_aux_features`), which
    runs each prefill alone, layer by layer: 77-84 s for 128 sequences on the H200
    (results/h200_bench_mtp_trained.txt), where transformers takes a batch in one forward. The
    callers check the first sequences against the oracle (`oracle_gap`)."""
    import torch
    from transformers import Qwen4ExpForCausalLM

    if len({len(seq) for seq in sequences}) > 1:
        raise RuntimeError("hf_streams: the sequences differ in length")
    net = Qwen4ExpForCausalLM.from_pretrained(str(model), dtype=torch.float32).to(device).eval()
    depth = net.config.num_hidden_layers
    captured: dict[int, Any] = {}

    def grab(index: int) -> Any:
        def hook(_module: Any, inputs: tuple[Any, ...]) -> None:
            captured[index] = inputs[0]  # the streams, [B, T, hc * H]

        return hook

    modules = [net.model.layers[i] if i < depth else net.model.hyper_connection_mixer for i in indices]
    handles = [module.register_forward_pre_hook(grab(i)) for i, module in zip(indices, modules, strict=True)]
    out: list[dict[int, Any]] = []
    try:
        with torch.no_grad(), reference_gated_delta_rule(device), batched_qsa_indexer():
            for first in range(0, len(sequences), batch):
                ids = torch.tensor(sequences[first : first + batch], device=device)
                net.model(input_ids=ids, use_cache=False)
                out += [{i: captured[i][b] for i in indices} for b in range(ids.shape[0])]
    finally:
        for handle in handles:
            handle.remove()
    del net
    return out


def oracle_gap(ours: list[Any], oracle: list[Any], one_layer_off: list[list[Any]] | None = None) -> dict[str, float]:
    """`oracle_gap_report`, raising unless `gap_passes`."""
    gap = oracle_gap_report(ours, oracle, one_layer_off)
    if not gap_passes(gap):
        raise RuntimeError(
            f"transformers' target streams are not the oracle's: relative gap by position {gap} (the median may be "
            f"at most {ORACLE_GAP_LIMIT:g}, and at most {ORACLE_LAYER_MARGIN:g} of the gap one layer off)"
        )
    return gap


def oracle_gap_report(
    ours: list[Any], oracle: list[Any], one_layer_off: list[list[Any]] | None = None
) -> dict[str, float]:
    """How far two lists of ``[T, D]`` tensors are apart, position by position (`position_gap`): the
    median and the largest over every position. With ``one_layer_off`` (the oracle's tensors of the
    layers next to the hooked ones, each list like ``oracle``), also the smallest median gap to those."""
    gap = position_gap(ours, oracle)
    if one_layer_off:
        gap["one_layer_off_median"] = min(position_gap(ours, other)["median"] for other in one_layer_off)
    return gap


def gap_passes(gap: dict[str, float]) -> bool:
    """The median is at most ``ORACLE_GAP_LIMIT`` and, where the report has it, at most
    ``ORACLE_LAYER_MARGIN`` times the gap one layer off."""
    off = gap.get("one_layer_off_median")
    return gap["median"] <= ORACLE_GAP_LIMIT and (off is None or gap["median"] <= ORACLE_LAYER_MARGIN * off)


def position_gap(ours: list[Any], oracle: list[Any]) -> dict[str, float]:
    """The largest difference at each position, relative to the oracle's largest value: its median
    and largest over every position."""
    import torch

    scale = max(float(b.abs().max()) for b in oracle)
    gaps = torch.cat([(a - b).abs().amax(dim=-1) for a, b in zip(ours, oracle, strict=True)]) / scale
    return {"median": float(gaps.median()), "max": float(gaps.max())}


# transformers' streams against the oracle's on the first sequences, fp32 both: batched and alone,
# a near-tie in a top-k (an expert, a QSA block) can flip at a position and move the streams after it.
# The CPU dry run: 3.8e-3 at one of 40 positions in the last layer, 1e-7 or less everywhere else; the
# H100 (2026-12-07), the medium target pretrained 100 s, whose generated text repeats (30 distinct
# tokens in 144): a median of 2.4e-4 at the DFlash features, where the random medium target's streams
# stay under 1.6e-6 at every layer (streams_check.py, the same machine). So the median is held to
# ORACLE_GAP_LIMIT, and a hook on the wrong module is told apart by comparing against the layers next
# to the hooked ones, which a hook one layer off matches to rounding: the right layer must be at most
# half as far. The gap between neighbouring layers can be small (the tiny random target's GDN layers:
# 7e-5, streams_check.py on CPU), so the limit alone cannot keep that margin.
ORACLE_GAP_LIMIT = 1e-3
ORACLE_LAYER_MARGIN = 0.5
ORACLE_CHECKED = 2


def head_loss(core: Any, head: Any, streams: Any, seq: list[int], device: str, chain: int = 1) -> tuple[Any, Any]:
    """Teacher-forced: the head at position p (streams p, token p + 1) predicts token p + 2; the loss
    and top-1 agreement of that first draft.

    With ``chain`` > 1 the loss also covers drafts 2 .. ``chain`` the way vLLM's proposer chains
    them: draft k's pass reads draft k - 1's output streams (not the target's) with the true token
    after it and predicts one token further, all positions at once. The one approximation: in that
    pass a position's attention sees the same pass's streams at earlier positions, where the
    proposer's cache holds the first pass's (the target-stream ones) below the anchor."""
    import torch
    import torch.nn.functional as F

    from qwen38_plugin.mtp_reference import MTPCache

    ids = torch.tensor(seq, device=device)
    n = ids.shape[0]
    out, logits = head.step(core, streams[: n - 2], ids[1 : n - 1], torch.arange(n - 2, device=device), MTPCache())
    target = ids[2:]
    loss, agreement = F.cross_entropy(logits.float(), target), (logits.argmax(-1) == target).float().mean()
    for k in range(1, chain):
        if n - 2 - k < 1:
            break
        # draft k + 1 from anchor p: draft k's streams at p, the token p + 1 + k, position p + k
        out, logits = head.step(core, out[:-1], ids[1 + k : n - 1], torch.arange(k, n - 2, device=device), MTPCache())
        loss = loss + F.cross_entropy(logits.float(), ids[2 + k :])
    return loss / max(1, min(chain, n - 2)), agreement


def evaluate(core: Any, head: Any, streams: list[Any], sequences: list[list[int]], device: str) -> dict[str, float]:
    import torch

    with torch.no_grad():
        pairs = [head_loss(core, head, s, q, device) for s, q in zip(streams, sequences, strict=True)]
    return {"loss": float(sum(p[0] for p in pairs) / len(pairs)), "top1": float(sum(p[1] for p in pairs) / len(pairs))}


def chain_acceptance(
    core: Any, head: Any, streams: list[Any], sequences: list[list[int]], drafts: int, device: str, anchors: int = 16
) -> dict[str, Any]:
    """The acceptance length greedy verification would give the head's chained drafts (each draft
    step reading the previous one's output streams and token, as vLLM's proposer runs it), at
    ``anchors`` random places in each held-out sequence's generated text: what vLLM should measure.
    Training teaches the first draft only (from the target's streams), so this tells how much the
    later drafts get from it. (`Qwen4ExpMTPReference.draft` runs the first pass token by token on
    CPU tensors; here it is one step over the anchor's prefix, on the training device.)"""
    import torch

    from dflash2.drafter_reference import expected_acceptance_length
    from qwen38_plugin.mtp_reference import MTPCache

    gen = torch.Generator().manual_seed(0)
    hits = []
    with torch.no_grad():
        for target, seq in zip(streams, sequences, strict=True):
            ids = torch.tensor(seq, device=device)
            # a: the target has read positions 0 .. a and token a + 1 is the one just sampled (generated:
            # a + 1 >= PROMPT_LEN); the drafts predict tokens a + 2 .. a + 1 + drafts
            low, high = PROMPT_LEN - 1, len(seq) - 1 - drafts
            if high <= low:
                continue
            for a in torch.randint(low, high, (anchors,), generator=gen).tolist():
                cache = MTPCache()
                out, logits = head.step(
                    core, target[: a + 1], ids[1 : a + 2], torch.arange(a + 1, device=device), cache
                )
                out, token, row = out[-1:], logits[-1].argmax(-1).view(1), []
                for j in range(drafts):
                    row.append(bool(token == ids[a + 2 + j]))
                    if j + 1 < drafts:
                        out, logits = head.step(core, out, token, torch.tensor([a + 1 + j], device=device), cache)
                        token = logits[-1].argmax(-1).view(1)
                hits.append(row)
    correct = torch.tensor(hits, dtype=torch.bool).view(-1, drafts)
    top1 = [round(float(x), 4) for x in correct.float().mean(0)]
    return {"drafts": drafts, "anchors": len(hits), "top1_by_position": top1,
            "expected_acceptance_length": expected_acceptance_length(correct)}  # fmt: skip


def text_statistics(sequences: list[list[int]]) -> dict[str, Any]:
    """How repetitive the generated text is (PROMPT_LEN on): its share of the single most frequent
    token, and the distinct tokens per sequence (a briefly trained target can write one token forever)."""
    generated = [seq[PROMPT_LEN:] for seq in sequences]
    counts = collections.Counter(t for seq in generated for t in seq)
    total = counts.total() or 1
    top, top_n = counts.most_common(1)[0] if counts else (None, 0)
    distinct = sum(len(set(s)) for s in generated) / max(1, len(generated))
    return {"most_frequent_token": top, "most_frequent_share": round(top_n / total, 4),
            "distinct_tokens_per_sequence": round(distinct, 1)}  # fmt: skip


def train(
    args: argparse.Namespace, model: Path, sequences: list[list[int]], device: str, trained: Path
) -> dict[str, Any]:
    """Stage 2: the MTP head trained on ``sequences``, written with its report to ``trained``."""
    import torch

    core, head = load_oracle(model, device)
    for p in core.parameters():
        p.requires_grad_(False)
    held_out = max(2, len(sequences) // 8)
    train_seqs, eval_seqs = sequences[held_out:], sequences[:held_out]
    start = time.perf_counter()
    depth = core.config.num_hidden_layers
    streams = [s[depth] for s in hf_streams(model, sequences, [depth], device)]
    streams_s = time.perf_counter() - start
    oracle = target_streams(core, sequences[:ORACLE_CHECKED], device, layers=[depth - 1, depth])
    gap = oracle_gap(streams[:ORACLE_CHECKED], [s[depth] for s in oracle], [[s[depth - 1] for s in oracle]])
    train_streams, eval_streams = streams[held_out:], streams[:held_out]
    report: dict[str, Any] = {"train_sequences": len(train_seqs), "eval_sequences": len(eval_seqs),
                              "target_streams_s": round(streams_s, 1), "oracle_gap": gap,
                              "before": evaluate(core, head, eval_streams, eval_seqs, device)}  # fmt: skip
    print(f"train: before {report['before']}", flush=True)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    losses = []
    for step in range(args.train_steps):
        i = int(torch.randint(0, len(train_seqs), (1,), generator=gen))
        loss, _ = head_loss(core, head, train_streams[i], train_seqs[i], device, chain=args.chain_train)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % max(1, args.train_steps // 10) == 0:
            print(f"train: step {step + 1}/{args.train_steps} loss {sum(losses[-20:]) / len(losses[-20:]):.3f}",
                  flush=True)  # fmt: skip
    report["train_s"] = round(time.perf_counter() - start, 1)
    report["after"] = evaluate(core, head, eval_streams, eval_seqs, device)
    print(f"train: after {report['after']} ({report['train_s']} s)", flush=True)
    drafts = max(int(d) for d in str(args.drafts).split(",") if d)
    report["after_chained"] = chain_acceptance(core, head, eval_streams, eval_seqs, drafts, device)
    print(f"train: chained drafts, predicted {report['after_chained']}", flush=True)
    report["checkpoint"] = str(trained)
    write_head(model, head, trained, report)
    return report


def write_head(source: Path, head: Any, destination: Path, report: dict[str, Any]) -> None:
    """A copy of ``source`` whose ``mtp.*`` tensors are the trained head's (on-disk names and dtypes);
    written beside and renamed into place, so a stopped run leaves no half-written checkpoint."""
    from safetensors.torch import load_file, save_file

    params = {name: p.detach().cpu() for name, p in head.named_parameters()}
    staging = destination.with_name(destination.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    for file in sorted(staging.glob("*.safetensors")):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            if not name.startswith("mtp."):
                continue
            key = name.removeprefix("mtp.")
            parts = key.split(".")
            if key in params:
                value = params[key]
            elif ".mlp.experts." in key and parts[-3].isdigit():
                prefix, expert, kind = ".".join(parts[:-3]), int(parts[-3]), parts[-2]
                if kind == "down_proj":
                    value = params[f"{prefix}.down_proj"][expert]
                else:
                    gate_up = params[f"{prefix}.gate_up_proj"][expert]
                    half = gate_up.shape[0] // 2
                    value = gate_up[:half] if kind == "gate_proj" else gate_up[half:]
            else:
                continue  # tensors the head does not train (e.g. the final mixer's unused injection)
            if tuple(value.shape) != tuple(tensor.shape):
                raise RuntimeError(f"write_head: {name}: trained shape {tuple(value.shape)} != {tuple(tensor.shape)}")
            tensors[name] = value.to(tensor.dtype).contiguous()
        save_file(tensors, str(file), metadata={"format": "pt"})
    (staging / "train_report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(destination, ignore_errors=True)
    staging.rename(destination)


# ---------------------------------------------------------------------------------------------
# The DFlash drafter (stage 3)
# ---------------------------------------------------------------------------------------------

# The mask token of the drafter's query slots: the pad token's embedding row is zero (a mask slot
# would get zero queries, so its attention could not depend on position); this special token's is not.
DFLASH_MASK_TOKEN = "<|fim_pad|>"
# Cross entropy weight of draft k (1-based): 0.8 ** (k - 1), since draft k only counts when drafts
# 1 .. k - 1 were accepted.
DFLASH_POSITION_DECAY = 0.8


def dflash_config_for(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """The drafter's config.json for the target ``model``: ``--dflash-layers`` causal Qwen3 layers at
    the target's width, reading the target's features after its first, middle and last layers."""
    from tokenizers import Tokenizer

    from dflash2.tiny import drafter_config

    target_config = json.loads((model / "config.json").read_text())
    text = target_config.get("text_config", target_config)
    layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
    mask = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id(DFLASH_MASK_TOKEN)
    if mask is None:
        raise RuntimeError(f"dflash_config_for: {model}'s tokenizer has no {DFLASH_MASK_TOKEN} token")
    config = drafter_config(
        target_config,
        num_hidden_layers=args.dflash_layers,
        target_layer_ids=sorted({0, layers // 2, layers - 1}),
        block_size=args.dflash_drafts + 1,  # the bonus token and the drafts: what vLLM runs per request
        causal=True,  # drafts then never see later ones, so any verify width keeps the same first drafts
        extra_dflash_config={"target_feature_reduction": "hc_mean", "mask_token_id": mask},
    )
    head_dim = 64 if hidden <= 256 else 128
    heads = max(2, hidden // head_dim)
    config.update(num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=head_dim,
                  intermediate_size=3 * hidden, dtype=args.dtype)  # fmt: skip
    return config


def train_dflash(
    args: argparse.Namespace, model: Path, sequences: list[list[int]], device: str, destination: Path
) -> dict[str, Any]:
    """Stage 3: a DFlash drafter trained on the target's own text, written with its report to
    ``destination`` (a directory vLLM loads as ``DFlashDraftModel``)."""
    import torch
    import torch.nn.functional as F

    from dflash2.drafter_reference import (
        DFlashDrafterReference,
        anchor_blocks,
        aux_layer_indices,
        block_attention_mask,
        expected_acceptance_length,
        qwen4exp_aux_features,
    )
    from qwen38_plugin.ops.hyper_connection import hc_mean

    config = dflash_config_for(args, model)
    if args.dflash_draft_vocab:
        config["draft_vocab_size"] = args.dflash_draft_vocab
    core, _ = load_oracle(model, device, with_head=False)
    # the target's embedding and lm_head, shared with the drafter as vLLM shares them, and frozen
    embed, lm_head = core.model.embed_tokens.weight.detach(), core.lm_head.weight.detach()
    indices = aux_layer_indices(config)
    held_out = max(2, len(sequences) // 8)
    start = time.perf_counter()
    tokens = [torch.tensor(seq, device=device) for seq in sequences]
    hc = core.config.hc_count
    features = [
        torch.cat([hc_mean(s[i], hc) for i in indices], dim=-1) for s in hf_streams(model, sequences, indices, device)
    ]
    features_s = time.perf_counter() - start
    depth = core.config.num_hidden_layers
    with torch.no_grad():
        oracle = qwen4exp_aux_features(core, tokens[:ORACLE_CHECKED], indices)
        # the features a hook one layer before or after each of ours would give
        shifted = [[i + shift for i in indices] for shift in (-1, 1)]
        one_layer_off = [
            qwen4exp_aux_features(core, tokens[:ORACLE_CHECKED], other)
            for other in shifted
            if all(0 <= i <= depth for i in other)
        ]
    gap = oracle_gap(features[:ORACLE_CHECKED], oracle, one_layer_off)
    del core
    train_ids, eval_ids = tokens[held_out:], tokens[:held_out]
    train_features, eval_features = features[held_out:], features[:held_out]

    drafts = args.dflash_drafts
    block = drafts + 1
    length = len(sequences[0])
    if any(len(seq) != length for seq in sequences):
        raise RuntimeError("train_dflash: the generated sequences differ in length")
    # anchors (the bonus token's position) in the generated text, every block inside the sequence
    low, high = PROMPT_LEN, length - drafts
    if high <= low:
        raise RuntimeError(f"train_dflash: sequences of {length} tokens leave no room for {drafts} drafts")
    drafter = DFlashDrafterReference(config).to(device)
    gen = torch.Generator().manual_seed(0)
    drafter.reset_parameters(gen)
    g = drafter.geometry
    # labels as draft rows: a target token outside a reduced draft vocabulary is -100, which the
    # loss leaves out and no argmax equals
    to_row = torch.arange(g.vocab_size, device=device)
    draft_vocab: dict[str, Any] = {"size": g.draft_vocab_size}
    if g.reduced_vocab:
        counts = torch.bincount(torch.cat([t[PROMPT_LEN:] for t in train_ids]), minlength=g.vocab_size)
        seen = int((counts > 0).sum())
        if seen < g.draft_vocab_size:
            draft_vocab["seen_in_training"] = seen
        # the most frequent first, ties by the smaller id (a stable sort of ids by falling count)
        order = torch.sort(-counts, stable=True).indices[: g.draft_vocab_size]
        drafter.set_draft_vocabulary(order, lm_head)
        drafter.lm_head.weight.requires_grad_(False)  # the target's rows, frozen as the full head is
        to_row = torch.full((g.vocab_size,), -100, dtype=torch.long, device=device)
        to_row[order.to(device)] = torch.arange(g.draft_vocab_size, device=device)
        held_labels = torch.cat([t[PROMPT_LEN:] for t in eval_ids])
        draft_vocab["held_out_coverage"] = round(float((to_row[held_labels] >= 0).float().mean()), 4)
        print(f"dflash: draft vocabulary {draft_vocab}", flush=True)
    head = drafter.lm_head.weight if g.reduced_vocab else lm_head
    weights = torch.tensor([DFLASH_POSITION_DECAY**k for k in range(drafts)], device=device)
    weights = weights / weights.sum()
    autocast = training_autocast(device)

    def blocks_forward(ids: list[Any], feats: list[Any], anchors: list[list[int]], amp: Any = None) -> tuple[Any, Any]:
        """Every anchor's block of each sequence in one forward (under ``amp``, else the training
        autocast); logits ``[B, blocks, drafts, V]`` over the draft rows and labels ``[B, blocks,
        drafts]`` as draft rows (-100: outside a reduced draft vocabulary)."""
        built = [anchor_blocks(t, a, block, g.mask_token_id) for t, a in zip(ids, anchors, strict=True)]
        query_ids = torch.stack([b[0] for b in built])
        query_positions = torch.stack([b[1] for b in built])
        labels = torch.stack([b[2] for b in built])
        attend = torch.stack([block_attention_mask(a, length, block, all(g.causal), device) for a in anchors])
        positions = torch.arange(length, device=device).expand(len(ids), length)
        with amp or autocast:
            hidden = drafter(
                drafter.context_states(torch.stack(feats)), positions, F.embedding(query_ids, embed),
                query_positions, attend,
            )  # fmt: skip
            rows = hidden.unflatten(1, (-1, block))[:, :, 1:]  # the bonus row drafts nothing
            logits = rows @ head.to(rows.dtype).t()
        return logits.float(), to_row[labels]

    def evaluate_dflash(amp: Any = None) -> dict[str, Any]:
        """Held-out loss, top-1 agreement with the target per draft position and the acceptance
        length greedy verification would give, over every anchor of the held-out sequences."""
        losses, correct = [], []
        every = list(range(low, high))
        with torch.no_grad():
            for ids, feats in zip(eval_ids, eval_features, strict=True):
                logits, labels = blocks_forward([ids], [feats], [every], amp)
                losses.append(float(F.cross_entropy(logits.flatten(0, 2), labels.flatten())))
                correct.append((logits.argmax(-1) == labels)[0])
        hits = torch.cat(correct)
        top1 = [round(float(x), 4) for x in hits.float().mean(0)]
        return {"loss": sum(losses) / len(losses), "top1_by_position": top1,
                "expected_acceptance_length": expected_acceptance_length(hits)}  # fmt: skip

    shown = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "dflash_config")  # fmt: skip
    report: dict[str, Any] = {"config": {k: config[k] for k in shown},
                              "drafts": drafts, "train_sequences": len(train_ids), "eval_sequences": len(eval_ids),
                              "target_features_s": round(features_s, 1), "oracle_gap": gap,
                              "max_steps": args.dflash_train_steps,
                              "max_seconds": args.dflash_train_seconds, "lr": args.dflash_lr,
                              "batch": args.dflash_batch, "blocks_per_sequence": args.dflash_blocks,
                              "draft_vocab": draft_vocab,
                              "before": evaluate_dflash()}  # fmt: skip
    print(f"dflash: before {report['before']}", flush=True)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.dflash_lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = time.perf_counter()
    step, printed, losses = 0, 0.0, []
    max_steps, max_seconds = args.dflash_train_steps, args.dflash_train_seconds

    # Early stopping: every tenth of the run the held-out sequences are evaluated and the drafter
    # with the longest predicted acceptance so far is kept (2026-12-06: a drafter trained on 112
    # sequences reached a training loss of 0.001 against 2.36 held out). The held-out sequences
    # are generated text the drafter never trains on; the measured prompts are other windows of
    # the held-out corpus, so the choice does not see them. Evaluation time is not training time.
    def kept(at_step: int, evaluation: dict[str, Any]) -> dict[str, Any]:
        """The drafter as it is now, with its step and held-out evaluation."""
        state = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
        return {"step": at_step, "evaluation": evaluation, "state": state}

    best = kept(0, report["before"])
    evaluated_s, history = 0.0, []
    while (done := run_fraction(step, max_steps, time.perf_counter() - start - evaluated_s, max_seconds)) < 1.0:
        for group in optimizer.param_groups:
            group["lr"] = args.dflash_lr * warmup_cosine(done)
        picked = torch.randint(0, len(train_ids), (args.dflash_batch,), generator=gen).tolist()
        anchors = [torch.randint(low, high, (args.dflash_blocks,), generator=gen).tolist() for _ in picked]
        logits, labels = blocks_forward([train_ids[i] for i in picked], [train_features[i] for i in picked], anchors)
        per_draft = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(-1, drafts)
        loss = (per_draft.mean(0) * weights).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        step += 1
        losses.append(float(loss.detach()))
        if done - printed >= 0.1:
            printed = done
            train_loss = sum(losses[-20:]) / len(losses[-20:])
            evaluated = time.perf_counter()
            evaluation = evaluate_dflash()
            evaluated_s += time.perf_counter() - evaluated
            acceptance = evaluation["expected_acceptance_length"]
            history.append({"step": step, "train_loss": round(train_loss, 4),
                            "held_out_loss": round(evaluation["loss"], 4),
                            "expected_acceptance_length": acceptance})  # fmt: skip
            if acceptance > best["evaluation"]["expected_acceptance_length"]:
                best = kept(step, evaluation)
            print(f"dflash: step {step} ({done:.0%} of the run) loss {train_loss:.3f}, held out "
                  f"{evaluation['loss']:.3f}, predicted acceptance {acceptance:.3f}", flush=True)  # fmt: skip
    report["steps_run"] = step
    report["train_s"] = round(time.perf_counter() - start - evaluated_s, 1)
    report["evaluations_s"] = round(evaluated_s, 1)
    report["history"] = history
    report["last"] = evaluate_dflash()
    if report["last"]["expected_acceptance_length"] >= best["evaluation"]["expected_acceptance_length"]:
        report["kept_step"], report["after"] = step, report["last"]
    else:
        drafter.load_state_dict(best["state"])
        report["kept_step"], report["after"] = best["step"], best["evaluation"]
    print(f"dflash: after {report['after']} (kept step {report['kept_step']} of {step}, {report['train_s']} s "
          f"training, {report['evaluations_s']} s held-out evaluations)", flush=True)  # fmt: skip
    report["drafter"] = str(destination)
    # written before the diagnostics below, so that a call cut short there keeps the trained drafter
    # (2026-12-03: one was cut inside the fp16 prediction and the next call trained it again)
    write_drafter(drafter, config, destination, report)
    # vLLM serves the drafter in the checkpoint's dtype; fp16 overflows where bf16 does not, so the
    # prediction again in fp16 tells whether that is why vLLM accepted fewer drafts than predicted
    # (2026-12-02 on the H200: 2.27 measured against 3.97 predicted in bf16)
    report["features_max_abs"] = max(float(f.abs().max()) for f in features)
    if device == "cuda" and args.dtype == "float16":
        report["after_float16"] = evaluate_dflash(torch.autocast("cuda", dtype=torch.float16))
        print(f"dflash: in float16 {report['after_float16']}", flush=True)
    print(f"dflash: largest target feature {report['features_max_abs']:.1f}", flush=True)
    partial = destination / "train_report.json.partial"
    partial.write_text(json.dumps(report, indent=2))
    partial.replace(destination / "train_report.json")
    return report


def write_drafter(drafter: Any, config: dict[str, Any], destination: Path, report: dict[str, Any]) -> None:
    """The drafter's directory (config.json, model.safetensors in ``config["dtype"]``, the report),
    written beside and renamed into place."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, config["dtype"])
    staging = destination.with_name(destination.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    # (a reduced vocabulary's d2t stays int64, as stock loads it)
    tensors = {
        name: t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
        for name, t in drafter.state_dict().items()
    }
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (staging / "train_report.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(destination, ignore_errors=True)
    staging.rename(destination)


# ---------------------------------------------------------------------------------------------


def best_of_rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One setting's measurement over its rounds: per batch size the fastest round's row, with every
    round's decode tok/s in ``decode_tok_s_rounds`` (a round that failed: its error, if none succeeded)."""
    combined: dict[str, Any] = {}
    for result in results:
        if "error" in result:
            continue
        for batch, row in result.items():
            speeds = combined.get(batch, {}).get("decode_tok_s_rounds", [])
            speeds = [*speeds, row.get("decode_tok_s")]
            best = combined.get(batch)
            if best is None or row.get("decode_tok_s", 0.0) > best.get("decode_tok_s", 0.0):
                best = row
            combined[batch] = {**best, "decode_tok_s_rounds": speeds}
    return combined or results[-1]


def print_table(report: dict[str, Any]) -> None:
    if "generated_text" in report:
        print(f"the target's generated text: {report['generated_text']}")
    plain = report["measure"].get("plain", {})
    print(f"{'setting':<22}{'batch':>6}{'seqs':>6}{'tok/s':>10}{'x plain':>9}{'same as plain':>14}{'accept len':>11}"
          "  accepted by draft position  tok/s by round")  # fmt: skip
    spread: list[str] = []
    for setting, rows in report["measure"].items():
        if "error" in rows:
            print(f"{setting:<22} error: {rows['error']}")
            continue
        for batch, row in rows.items():
            seqs = f"{row.get('sequences', '?'):>6}"
            accept = f"{row['acceptance_length']:11.2f}" if "acceptance_length" in row else f"{'':>11}"
            by_position = " ".join(f"{a:.2f}" for a in row.get("accepted_by_position", []))
            # greedy speculation keeps the target's tokens: sequences equal to plain's (fp16 ties aside)
            same = f"{'':>14}"
            base_tokens = plain.get(batch, {}).get("tokens")
            if setting != "plain" and base_tokens and row.get("tokens"):
                equal = sum(a == b for a, b in zip(row["tokens"], base_tokens, strict=False))
                same = f"{equal:>11}/{len(row['tokens']):<2}"
            if len(row.get("acceptance_by_group", [])) > 1:
                spread.append(f"{setting} at batch {batch}, acceptance length by group of {batch}: "
                              + " ".join(f"{a:.2f}" for a in row["acceptance_by_group"]))  # fmt: skip
            if "decode_tok_s" not in row:
                error = row.get("error", "")
                print(f"{setting:<22}{batch:>6}{seqs}{'-':>10}{'':>9}{same}{accept}  {by_position}  {error}")
                continue
            base = plain.get(batch, {}).get("decode_tok_s")
            ratio = f"{row['decode_tok_s'] / base:9.2f}" if base else f"{'':>9}"
            by_round = " / ".join("-" if v is None else f"{v:.0f}" for v in row.get("decode_tok_s_rounds", []))
            print(f"{setting:<22}{batch:>6}{seqs}{row['decode_tok_s']:10.1f}{ratio}{same}{accept}  {by_position}"
                  f"  {by_round}")  # fmt: skip
    for line in spread:
        print(line)
    if "after_chained" in report.get("train", {}):
        chained = report["train"]["after_chained"]
        print(
            f"mtp{chained['drafts']}-trained: held-out acceptance length predicted by the reference "
            f"{chained['expected_acceptance_length']:.2f} (top-1 by draft position {chained['top1_by_position']})"
        )
    if "dflash_train" in report:
        # the reference's teacher-forced prediction on held-out text, to set beside vLLM's measurement
        after = report["dflash_train"]["after"]
        vocab = report["dflash_train"].get("draft_vocab", {})
        reduced = f"-v{vocab['size']}" if "held_out_coverage" in vocab else ""
        print(
            f"dflash{report['dflash_train']['drafts']}{reduced}-trained: held-out acceptance length predicted by the "
            f"reference {after['expected_acceptance_length']:.2f} (top-1 by draft position {after['top1_by_position']})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", default="medium", choices=sorted(CONFIGS))
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--train-steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--chain-train", type=int, default=1,
        help="train the MTP head's first N chained drafts (head_loss); 1: the first draft only",
    )  # fmt: skip
    parser.add_argument("--drafts", default="1,3")
    parser.add_argument(
        "--no-untrained",
        action="store_true",
        help="measure the trained head only (one vLLM child fewer per draft count: fits a 10-minute device call)",
    )
    parser.add_argument("--batches", default="1,4,8,64")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="measure every setting this many times, each time in a new process, round after round: the best counts",
    )  # fmt: skip
    parser.add_argument(
        "--min-sequences",
        type=int,
        default=8,
        help="each batch size serves at least this many sequences, in groups of the batch size one after another",
    )
    parser.add_argument("--capture-sizes", default="measured", choices=("measured", "vllm"), help=CAPTURE_SIZES_HELP)
    parser.add_argument("--work", type=Path, default=Path("/tmp/qwen38_bench_mtp"))
    parser.add_argument("--timeout", type=int, default=600, help="seconds per vLLM child")
    parser.add_argument("--pretrain-steps", type=int, default=0, help="stage 0: train the target first (0: random)")
    parser.add_argument("--pretrain-seconds", type=int, default=0, help="stage 0 ends after this long (0: no limit)")
    parser.add_argument("--pretrain-lr", type=float, default=1e-3)
    parser.add_argument("--pretrain-batch", type=int, default=16)
    parser.add_argument("--pretrain-seq-len", type=int, default=256)
    parser.add_argument("--corpus-tokens", type=int, default=4_000_000, help="of the stdlib corpus (stage 0)")
    parser.add_argument("--methods", default="mtp,dflash", help="speculative methods to train and measure")
    parser.add_argument("--dflash-drafts", type=int, default=3, help="DFlash drafts per step (block = drafts + 1)")
    parser.add_argument("--dflash-layers", type=int, default=1, help="DFlash drafter layers")
    parser.add_argument("--dflash-train-steps", type=int, default=20_000)
    parser.add_argument("--dflash-train-seconds", type=int, default=140, help="stage 3 ends after this long (0: none)")
    parser.add_argument("--dflash-lr", type=float, default=1e-3)
    parser.add_argument("--dflash-batch", type=int, default=8, help="sequences per DFlash training step")
    parser.add_argument("--dflash-blocks", type=int, default=16, help="anchor blocks per sequence per step")
    parser.add_argument(
        "--dflash-draft-vocab", type=int, default=0,
        help="draft from this many of the training text's most frequent tokens (0: the whole vocabulary)",
    )  # fmt: skip
    parser.add_argument(
        "--stop-after", choices=("pretrain", "generate", "train", "dflash-train"), help="stop after this stage"
    )
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", help="on CPU: tiny, float32, a few sequences and steps")
    parser.add_argument("--child", choices=("generate", "measure"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--drafts-one", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--drafter", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batches = [int(b) for b in str(args.batches).split(",") if b]
    methods = {m for m in str(args.methods).split(",") if m}
    if methods - {"mtp", "dflash"} or not methods:
        parser.error(f"--methods: {args.methods!r}: a comma-separated subset of mtp,dflash")
    if args.child:
        args.drafts = args.drafts_one
        result = child_generate(args) if args.child == "generate" else child_measure(args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.dry_run:
        # the CPU's sizes, for every value not given on the command line
        given = {a.split("=")[0] for a in sys.argv[1:] if a.startswith("--")}
        small = {"config": "tiny", "dtype": "float32", "sequences": 6, "new_tokens": 24, "train_steps": 12,
                 "batches": [1, 2], "repeats": 1, "drafts": "2", "pretrain_steps": min(args.pretrain_steps, 4),
                 "min_sequences": 2, "pretrain_batch": 2, "pretrain_seq_len": 64, "corpus_tokens": 20_000,
                 "dflash_train_steps": 12, "dflash_train_seconds": 0, "dflash_batch": 2,
                 "dflash_blocks": 8}  # fmt: skip
        for name, value in small.items():
            if f"--{name.replace('_', '-')}" not in given:
                setattr(args, name, value)
    import torch

    args.cpu = not torch.cuda.is_available()
    if args.cpu and not args.dry_run:
        parser.error(
            "no CUDA device here: pass --dry-run to prove the script on CPU (its numbers are not measurements)"
        )
    device = "cpu" if args.cpu else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    model = build_checkpoint(args.work, args.config, args.dtype)
    report: dict[str, Any] = {"config": args.config, "dtype": args.dtype, "device": device,
                              "name": torch.cuda.get_device_name() if not args.cpu else "CPU",
                              "prompt_len": PROMPT_LEN, "new_tokens": args.new_tokens, "measure": {}}  # fmt: skip

    def save() -> None:
        (args.out / "bench_mtp_trained.json").write_text(json.dumps(report, indent=2))

    args.corpus = None
    if args.pretrain_steps:
        args.corpus = str(corpus_tokens(args.work, model, args.corpus_tokens))
        model, report["pretrain"] = pretrain(args, model, Path(args.corpus), device)
        report["pretrain"]["python"] = sys.version.split()[0]
        save()
    if args.stop_after == "pretrain":
        return
    tag = f"{model.name}-{args.sequences}x{args.new_tokens}"
    cached = args.work / f"generated-{tag}.json"
    if cached.exists():
        generated = json.loads(cached.read_text())
    else:
        generated = run_child("generate", args, model, "generate", args.timeout)
        if "error" in generated:
            report["generate"] = generated
            save()
            sys.exit(f"generate failed: {generated['error']}")
        cached.write_text(json.dumps(generated))
    report["generated_text"] = text_statistics(generated["sequences"])
    print(f"generate: {report['generated_text']}", flush=True)
    if args.stop_after == "generate":
        return
    chained = f"-chain{args.chain_train}" if args.chain_train > 1 else ""
    trained = args.work / f"{tag}-trained-{args.train_steps}-lr{args.lr}{chained}"
    if "mtp" in methods:
        if (trained / "train_report.json").exists():
            report["train"] = json.loads((trained / "train_report.json").read_text())
        else:
            report["train"] = train(args, model, generated["sequences"], device, trained)
        save()
    if args.stop_after == "train":
        return
    # every setting that changes the drafter is in its name
    vocab = f"-v{args.dflash_draft_vocab}" if args.dflash_draft_vocab else ""
    drafter = args.work / (
        f"{tag}-dflash{args.dflash_drafts}-l{args.dflash_layers}-{args.dflash_train_steps}-{args.dflash_train_seconds}s"
        f"-lr{args.dflash_lr}-b{args.dflash_batch}x{args.dflash_blocks}{vocab}"
    )
    if "dflash" in methods:
        if (drafter / "train_report.json").exists():
            report["dflash_train"] = json.loads((drafter / "train_report.json").read_text())
        else:
            report["dflash_train"] = train_dflash(args, model, generated["sequences"], device, drafter)
        save()
    # what each setting serves, for profile_gpu.py --trained (part l of h200_session.sh)
    report["paths"] = {"plain": str(model), "mtp": str(trained) if "mtp" in methods else None,
                       "dflash": str(drafter) if "dflash" in methods else None, "corpus": args.corpus}  # fmt: skip
    save()
    if args.stop_after == "dflash-train":
        return
    # (name, target checkpoint, drafts, DFlash drafter or None)
    settings: list[tuple[str, Path, int, Path | None]] = [("plain", model, 0, None)]
    if "mtp" in methods:
        for drafts in [int(d) for d in str(args.drafts).split(",") if d]:
            if not args.no_untrained:
                settings.append((f"mtp{drafts}-untrained", model, drafts, None))
            settings.append((f"mtp{drafts}-trained", trained, drafts, None))
    if "dflash" in methods:
        settings.append((f"dflash{args.dflash_drafts}{vocab}-trained", model, args.dflash_drafts, drafter))
    # Round after round, every setting in its own process each time (plain, MTP, DFlash, plain, ...): the
    # host's speed moves between processes and over minutes (2026-12-04: the same setting's step cost
    # against plain's 1.07x in one session and 2.05x in the next), so each reading is the best round's.
    rounds: dict[str, list[dict[str, Any]]] = {}
    batches = ",".join(map(str, args.batches))
    for round_ in range(1, args.rounds + 1):
        for name, checkpoint, drafts, dflash in settings:
            later = f"-round{round_}" if round_ > 1 else ""  # (round 1 keeps the name of runs before --rounds)
            measured = args.work / (
                f"measure-{checkpoint.name}{f'-{dflash.name}' if dflash else ''}-d{drafts}-b{batches}"
                f"-n{args.new_tokens}-r{args.repeats}-m{args.min_sequences}{later}.json"
            )
            if measured.exists():
                result = json.loads(measured.read_text())
            else:
                result = run_child("measure", args, checkpoint, name, args.timeout, drafts=drafts, drafter=dflash)
                if "error" not in result:
                    measured.write_text(json.dumps(result))
            rounds.setdefault(name, []).append(result)
            report["measure"][name] = best_of_rounds(rounds[name])
            save()
            print(f"measure {name} round {round_}: {json.dumps(result)}", flush=True)
    print_table(report)


if __name__ == "__main__":
    main()
