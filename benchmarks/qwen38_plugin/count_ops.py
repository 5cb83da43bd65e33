"""Which code issues how many ops in one decode step of the portable Qwen4Exp inside stock vLLM (CPU).

    .venv/bin/python tests/engines.py .venv/bin/python benchmarks/qwen38_plugin/count_ops.py \\
        [--config medium] [--dtype bfloat16] [--batches 1,4] [--prompt-len 128] [--model DIR] [--qsa-triton]
        [--speculative mtp|dflash|none [--drafts 3]] [--top 40] [--out FILE]

On a GPU a decode step of this model is about a thousand small kernels; this counts, on CPU, the
aten operations behind them and says which part of the code issued each. It starts stock vLLM in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``enforce_eager=True``) on a random checkpoint
of ``--config`` (bench_cpu.py's configs, built under .cache/bench/ unless ``--model`` names one),
and for each batch size B runs B fresh prompts with ``max_tokens=2`` (after a warm-up) under a
`TorchDispatchMode` switched on inside the model runner's ``execute_model`` and ``sample_tokens``
only: one record per engine step, from which the first all-decode step of B requests is printed
(the prefill step's total too).

What counts as one op: every aten op that computes or writes tensor data (arithmetic,
reductions, copies and fills, index ops, matmuls, ...), and every non-aten custom op
(``torch.ops._C.*`` and the like) as one. Not counted: views and metadata (``func.is_view``,
split / unbind, allocations such as ``empty``, size queries), and aten ops whose results are all
empty (a ``fill_`` of an empty padding slice launches no kernel). Composite ops (``reshape``,
``contiguous``, ``to``, ``linear``, ``einsum``, ...) are decomposed, so only what they really run
counts (``contiguous`` of a contiguous tensor counts nothing). ``torch.ops.vllm.*`` ops are Python
functions around the real work: they are not counted themselves, the ops they run are.

Where an op is attributed:
- inside the model (its forward, and ``compute_logits``' LogitsProcessor): to the innermost module
  running, by its path in the model with the layer index collapsed (``layers.*.mlp``,
  ``layers.*(indexed_attention).self_attn``); inside a ``torch.ops.vllm`` op, also to the op and
  to the innermost qwen38_plugin function that issued it
  (``[qwen38_qsa_attention: ops.qsa_paged.index_topk]``);
- outside the model (input preparation, the cache groups' metadata builders, the sampler): to the
  innermost vLLM or qwen38_plugin function, and the model runner's method that led there.
Each op also carries its issuing function (innermost vLLM / qwen38_plugin frame) for the third table.

``--speculative``: the checkpoint gets a random MTP head (and for ``dflash`` a random one-layer
drafter, profile_gpu.py's), prefix caching is off, and the decode step counted is the first verify
step (each request one token plus its drafts), the drafter's proposal included (outside the model,
``<- runner.propose_draft_token_ids``); ``none`` is the same engine without speculation.
Host syncs on CUDA (``.item()``, ``nonzero``, boolean-mask indexing, ...) are listed separately.

Printed (and written to ``--out`` with a header on what differs on CUDA): 1. ops per component at each
batch size, with totals; 2. the top (component, aten op) pairs; 3. the top (component, issuing
function) pairs; 4. every op outside the model by source line, with the line's code; 5. the ops that
read a value back to the host.

``--qsa-triton`` runs QSA's paged ops (`ops.qsa_paged`) on the Triton path they take on CUDA, under
``TRITON_INTERPRET=1`` (slow: minutes), each kernel launch counted as one op; the GDN core and the MoE
keep their CPU paths (see HEADER).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib
import linecache
import os
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "qwen38_plugin"))
bench_cpu: Any = importlib.import_module("bench_cpu")  # the configs, checkpoints and prompts of bench_cpu.py

# Ops that allocate or describe tensors without touching their data (no kernel on a GPU).
NO_KERNEL = frozenset(
    {
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "resize_as_",
        "set_", "lift_fresh", "detach", "detach_", "alias", "_unsafe_view", "split", "split_with_sizes", "unbind",
        "chunk", "tensor_split", "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk", "sym_size", "sym_stride",
        "sym_numel", "sym_storage_offset", "size", "stride", "numel", "dim", "is_contiguous", "is_same_size",
        "_has_compatible_shallow_copy_type", "record_stream", "_nested_tensor_size", "is_pinned",
        # torch.where(mask, x, 0.0) wraps the Python scalar in a CPU tensor on every device
        "scalar_tensor",
    }
)  # fmt: skip
# Ops that read a device value back to the host on CUDA (the step waits for the GPU there).
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "unique", "_unique2"})
# Frames whose module names start so are "code of ours or vLLM's" for the attribution.
OWN_MODULES = ("qwen38_plugin", "vllm")
RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner")
H200_MULTIPROCESSORS = 132

HEADER = """
What is counted: the aten ops of ONE engine step (the model runner's execute_model + sample_tokens) that compute or
write tensor data, each of which is at least one kernel on a GPU; composite ops decomposed to what they run; views,
allocations, size queries and ops with empty results not counted; each non-aten custom op (torch.ops._C.*) one;
torch.ops.vllm.* ops are Python functions, the ops inside them are counted (attributed as [op: issuing qwen38_plugin
function]). Components: the innermost module running (its path with the layer index collapsed; 'layers: instances'
= how many layers contributed; a container's own code gets [function]), or outside the model the innermost vLLM /
qwen38_plugin function <- the model runner's method.

CAVEAT: these are CPU counts. The kernels of a CUDA step differ where the code branches on the device:
- layers.*(linear_attention).linear_attn: on CPU PortableGatedDeltaNet.forward_cpu runs the custom op
  vllm.qwen38_gdn_core_cpu (plain torch: ops.gdn_varlen.gdn_core_step gathers the state slots, causal conv, delta
  rule, scatters them back) and the plain-torch ops.gdn.gated_rms_norm. On CUDA stock's
  QwenGatedDeltaNetAttention.forward_cuda runs vLLM's op vllm.qwen_gdn_attention_core (Triton causal_conv1d_update
  and fused recurrent gated delta rule) and vLLM's RMSNormGated: a few kernels a layer. Every
  [qwen38_gdn_core_cpu: ...] row and the gated_rms_norm ops are CPU-only; the three projections are the same.
- layers.*(indexed_attention).self_attn [qwen38_qsa_attention: ...]: ops.qsa_paged.use_triton() is true for CUDA
  tensors: write_kv, write_rows, group_keys, index_topk (scores + selection) and sparse_attention (+ split merge)
  are one Triton kernel each there; on CPU their torch references run (*_torch, key_positions, rotary_cos_sin,
  _lookup: hundreds of ops). `--qsa-triton` counts that CUDA path under TRITON_INTERPRET=1 (each launch one op):
  results/op_count_cpu_qsa_triton.txt. The projections, q/k norms and RoPE before the op are the same code.
- layers.*.mlp.experts: vLLM's CPU MoE (router top-k in torch, then a CPU fused-MoE op) vs CUDA's fused Triton MoE
  (top-k softmax, block alignment, two fused_moe kernels, activation, sum; ~6-8 kernels a layer).
- linear layers: one op each on CPU (_C.onednn_mm / _C.weight_packed_linear / mm) and one cuBLAS GEMM on CUDA (a
  split-K GEMM adds a reduction kernel). vLLM's SiluAndMul (mlp.shared_expert.act_fn): silu + mul on CPU, one
  _C.silu_and_mul kernel on CUDA.
- casts: bf16 unless --dtype says otherwise; the H200 profile ran fp16, with the same casts (x.float(),
  .to(dtype)); in fp32 they vanish (.float() of an fp32 tensor runs nothing).
- outside the model: every CpuGpuBuffer.copy_to_gpu (vllm/v1/utils.py:143 in table 4) is one host-to-device copy
  on CUDA; it shows as copy_(h2d) where the CPU model runner made the buffer's two sides one tensor, as copy_ where
  they stay two (the block tables). Ops on host tensors (*_cpu, numpy-backed; e.g.
  split_decodes_and_prefills, the GDN builder's query_lens_cpu arithmetic) are counted here but are host work on
  CUDA, not kernels (table 4 shows each line's code); torch.tensor(..., device=cuda) copies are not seen at all.
  Table 5 lists the ops that read a value back to the host; on CUDA they are syncs only where the tensor is on
  the device (the split_decodes_and_prefills rows read host tensors there).
- PLE tables: read from host memory on CPU, through a pinned UVA view on CUDA: the same ops. The sampler:
  qwen38_plugin.cpu_seeded_sampling patches CPU only (seeded sampling; this run is greedy).
- CUDA graphs (the H200 default) replay the model forward's kernels; they do not change their number.
"""
LAYER_PATH = re.compile(r"^(?:model\.)?layers\.(\d+)(?:\.(.*))?$")


def _tensors(values: Any) -> Iterator[Any]:
    import torch

    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list | tuple):
            yield from _tensors(value)


def _frame_name(frame: FrameType) -> str:
    module = str(frame.f_globals.get("__name__", "?"))
    # ours by their path in the package (ops.qsa_paged), vLLM's by their module's name (gpu_model_runner)
    module = module.removeprefix("qwen38_plugin.") if module.startswith("qwen38_plugin.") else module.rsplit(".", 1)[-1]
    name = f"{module}.{frame.f_code.co_qualname}".replace("<locals>.", "")
    return name.replace("gpu_model_runner.GPUModelRunner.", "runner.")


def _location(frame: FrameType) -> str:
    """``path:line`` of a frame (from the package root: ``vllm/...``, ``qwen38_plugin/...``)."""
    path = frame.f_code.co_filename
    for root in ("/site-packages/", "/src/qwen38_plugin/"):
        path = path.rsplit(root, 1)[-1]
    return f"{path}:{frame.f_lineno}"


@dataclass
class Step:
    """The ops of one engine step (``execute_model`` and the ``sample_tokens`` after it)."""

    num_reqs: int
    num_tokens: int
    decode: bool
    ops: Counter[tuple[str, str, str, str]] = field(default_factory=Counter)  # (where, component, op, function)
    layers: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    syncs: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (op, component, path:line)
    lines: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # outside: (path:line, function, op)

    def total(self, where: str | None = None) -> int:
        return sum(n for (w, *_), n in self.ops.items() if where is None or w == where)


class OpCounter:
    """Counts the ops of the engine steps run while ``armed`` (see the module docstring)."""

    def __init__(self, layer_types: list[str]) -> None:
        self.layer_types = layer_types
        self.armed = False
        self.steps: list[Step] = []
        self.modules: list[str] = []  # paths of the model's modules running, innermost last
        self.custom_ops: list[str] = []  # torch.ops.vllm ops running, innermost last
        self.counting = 0  # > 0 inside a counted execute_model / sample_tokens
        self.paused = 0  # > 0 inside a Triton kernel run by the interpreter (counted as one op)
        self.mode = self._make_mode()

    # -- the model's modules -------------------------------------------------------------------
    def hook(self, model: Any) -> None:
        """Track the running module by wrapping each module's ``forward`` (vLLM's
        ``support_torch_compile`` calls ``forward`` past the module hooks) and the hyper-connection
        mixers' ``mix`` (their parents call it instead of ``forward``)."""
        for name, module in model.named_modules():
            for method in ("forward", "mix"):
                if callable(getattr(module, method, None)):
                    setattr(module, method, self._tracked(name or "(root)", getattr(module, method)))

    def _tracked(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            self.modules.append(name)
            try:
                return method(*args, **kwargs)
            finally:
                self.modules.pop()

        return tracked

    def component(self) -> tuple[str, int | None, bool]:
        """(the innermost module's path with the layer index collapsed, the layer index, whether the
        module is a container running code of its own: the model, a decoder layer)."""
        path = self.modules[-1]
        match = LAYER_PATH.match(path)
        if match is None:
            return path.removeprefix("model."), None, path in ("(root)", "model")
        index, rest = int(match.group(1)), match.group(2)
        if rest is None:
            return f"layers.*({self.layer_types[index]})", index, True
        if rest.split(".")[0] in ("linear_attn", "self_attn"):
            return f"layers.*({self.layer_types[index]}).{rest}", index, False
        return f"layers.*.{rest}", index, False

    # -- the steps -----------------------------------------------------------------------------
    def wrap_runner(self, runner: Any) -> None:
        """Count inside the runner's ``execute_model`` / ``sample_tokens`` (in whatever thread runs them)."""
        execute_model, sample_tokens = runner.execute_model, runner.sample_tokens

        def counted_execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.armed:
                return execute_model(scheduler_output, *args, **kwargs)
            scheduled = scheduler_output.num_scheduled_tokens
            # a decode step: every request one token, or one plus its drafts under speculation
            drafts = scheduler_output.scheduled_spec_decode_tokens
            decode = not scheduler_output.scheduled_new_reqs and all(
                n == 1 + len(drafts.get(req, ())) for req, n in scheduled.items()
            )
            self.steps.append(Step(len(scheduled), scheduler_output.total_num_scheduled_tokens, decode))
            with self._counting():
                return execute_model(scheduler_output, *args, **kwargs)

        def counted_sample_tokens(*args: Any, **kwargs: Any) -> Any:
            if not self.armed or not self.steps:
                return sample_tokens(*args, **kwargs)
            with self._counting():
                return sample_tokens(*args, **kwargs)

        runner.execute_model = counted_execute_model
        runner.sample_tokens = counted_sample_tokens

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        self.counting += 1
        try:
            with self.mode:
                yield
        finally:
            self.counting -= 1

    def count_triton_launches(self) -> None:
        """Count each launch of a Triton kernel under ``TRITON_INTERPRET=1`` as one op
        (``triton.<kernel>``), not the torch ops the interpreter runs for it."""
        from triton.runtime.interpreter import InterpretedFunction

        launch = InterpretedFunction.run

        def counted_launch(kernel: Any, *args: Any, **kwargs: Any) -> Any:
            if self.counting and not self.paused:
                self.record(f"triton.{kernel.fn.__name__}", sync=False)
            self.paused += 1
            try:
                return launch(kernel, *args, **kwargs)
            finally:
                self.paused -= 1

        InterpretedFunction.run = counted_launch

    def record(self, op: str, sync: bool) -> None:
        if self.paused:
            return
        step = self.steps[-1]
        innermost: FrameType | None = None  # innermost frame of vLLM or ours
        ours: str | None = None  # innermost function of qwen38_plugin
        runner: str | None = None  # innermost function of the model runner
        frame: FrameType | None = sys._getframe(2)
        while frame is not None and (ours is None or runner is None):
            module = str(frame.f_globals.get("__name__", ""))
            if module.startswith(OWN_MODULES):
                innermost = innermost or frame
                if module.startswith("qwen38_plugin") and ours is None:
                    ours = _frame_name(frame)
                if module.startswith(RUNNER_MODULES) and runner is None:
                    runner = _frame_name(frame)
            frame = frame.f_back
        function = _frame_name(innermost) if innermost is not None else "?"
        if self.modules:
            where = "model"
            component, layer, container = self.component()
            if self.custom_ops:
                component += f" [{self.custom_ops[-1]}: {ours or function}]"
            elif container:
                component += f" [{ours or function}]"  # which function of the container's own code
            if layer is not None:
                step.layers[component].add(layer)
        else:
            where, layer = "outside", None
            component = function if runner in (None, function) else f"{function} <- {runner}"
            if innermost is not None:
                step.lines[(_location(innermost), function, op)] += 1
        step.ops[(where, component, op, function)] += 1
        if sync:
            step.syncs[(op, component, _location(innermost) if innermost is not None else "?")] += 1

    def _make_mode(self) -> Any:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        composite = torch._C.DispatchKey.CompositeImplicitAutograd
        below_python = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                namespace, name = func.namespace, func._opname
                if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), composite):
                    with self:  # count what the composite op runs
                        result = func.decompose(*args, **kwargs)
                    if result is not NotImplemented:
                        return result
                if namespace == "vllm":
                    # A Python custom op of vLLM or ours: count the ops its function runs.
                    keys = torch._C._dispatch_keyset_full()
                    for tensor in _tensors([*args, *kwargs.values()]):
                        keys = torch._C._dispatch_keys(tensor)
                        break
                    counter.custom_ops.append(name)
                    try:
                        with self:
                            return func.redispatch(keys & below_python, *args, **kwargs)
                    finally:
                        counter.custom_ops.pop()
                result = func(*args, **kwargs)
                if namespace in ("aten", "prims") and (func.is_view or name in NO_KERNEL):
                    return result
                written = list(_tensors([result]))
                if namespace == "aten" and written and all(t.numel() == 0 for t in written):
                    return result  # nothing to write (e.g. a fill_ of an empty padding slice): no kernel
                label = name if namespace == "aten" else f"{namespace}.{name}"
                if name == "copy_" and args[0].data_ptr() == args[1].data_ptr():
                    label = "copy_(h2d)"  # a CpuGpuBuffer's copy_to_gpu: its two sides are one tensor on CPU
                sync = name in SYNC_OPS or (
                    name in ("index", "index_put_", "index_put")
                    and any(t.dtype == torch.bool for t in _tensors(args[1:2]))
                )
                counter.record(label, sync)
                return result

        return Mode()


def engine_runner(llm: Any) -> Any:
    """The model runner of an in-process engine (vLLM 0.32: LLMEngine -> InprocClient -> EngineCore
    -> UniProcExecutor -> WorkerWrapperBase -> CPUWorker -> CPUModelRunner)."""
    obj: Any = llm.llm_engine
    for attr in ("engine_core", "engine_core", "model_executor", "driver_worker", "worker", "model_runner"):
        if not hasattr(obj, attr):
            raise SystemExit(
                f"count_ops: {type(obj).__name__} has no {attr!r}; is the engine in-process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING=0)?"
            )
        obj = getattr(obj, attr)
    return obj


def run(args: argparse.Namespace) -> tuple[dict[int, Step], dict[int, Step], list[str]]:
    """Start the engine, count the steps of each batch size; returns (decode step, prefill step) per
    batch size and notes on the engine."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if args.qsa_triton:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit decorates qsa_paged's kernels
    import json

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra: dict[str, Any] = {}
    if args.speculative:
        # the target with a random MTP head, and for DFlash a random one-layer drafter (profile_gpu.py's)
        from profile_gpu import speculative_engine

        args.work = Path(".cache/bench")
        model, extra = speculative_engine(args)
    else:
        model = args.model or bench_cpu.checkpoint(args.config)
    layer_types = json.loads((Path(model) / "config.json").read_text())["layer_types"]
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(
        model=str(model), dtype=args.dtype, max_model_len=args.prompt_len + 64, seed=0, max_num_seqs=max(batches),
        enforce_eager=True, **extra,
    )  # fmt: skip
    runner = engine_runner(llm)
    counter = OpCounter(layer_types)
    counter.hook(runner.get_model())
    counter.wrap_runner(runner)
    notes: list[str] = []
    if args.qsa_triton:
        from qwen38_plugin.ops import qsa_paged

        # The CUDA path of every qsa_paged op, through the interpreter; the attention's split
        # heuristic sized for an H200 (132 multiprocessors), as it decides there.
        qsa_paged.use_triton = lambda x, backend="auto": backend != "torch"
        qsa_paged._multiprocessors = lambda device: H200_MULTIPROCESSORS  # type: ignore[assignment]
        counter.count_triton_launches()
        notes.append("QSA (qsa_paged) on its Triton path under TRITON_INTERPRET=1, each kernel launch one op")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ps = bench_cpu.prompts(1 + sum(batches), args.prompt_len)
    warm = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=ps.pop())], params, use_tqdm=False)
    notes.append(f"warm-up generate: {time.perf_counter() - warm:.1f} s")
    decode: dict[int, Step] = {}
    prefill: dict[int, Step] = {}
    for batch in batches:
        # Fresh prompts (no prefix-cache hits), all submitted at once.
        inputs = [TokensPrompt(prompt_token_ids=ps.pop()) for _ in range(batch)]
        counter.steps = []
        counter.armed = True
        try:
            llm.generate(inputs, params, use_tqdm=False)
        finally:
            counter.armed = False
        notes.append(
            f"batch {batch}: steps counted (requests, tokens, decode?): "
            + ", ".join(f"({s.num_reqs}, {s.num_tokens}, {'decode' if s.decode else 'prefill'})" for s in counter.steps)
        )
        decodes = [s for s in counter.steps if s.decode and s.num_reqs == batch]
        prefills = [s for s in counter.steps if not s.decode]
        if not decodes or not prefills:
            raise SystemExit(f"count_ops: no decode step of {batch} requests among {notes[-1]}")
        decode[batch], prefill[batch] = decodes[0], prefills[0]
    return decode, prefill, notes


def tables(decode: dict[int, Step], prefill: dict[int, Step], top: int) -> str:
    batches = sorted(decode)
    first = batches[0]
    cols = "".join(f"{f'b={b}':>7s}" for b in batches)
    out: list[str] = []

    def rows(counts_of: Callable[[Step], Counter[Any]]) -> list[tuple[Any, list[int]]]:
        counts = {b: counts_of(decode[b]) for b in batches}
        keys: set[Any] = set().union(*counts.values())
        table = [(k, [counts[b][k] for b in batches]) for k in keys]
        return sorted(table, key=lambda row: (*(-n for n in row[1]), str(row[0])))

    def ops_by(index: Callable[[tuple[str, str, str, str]], Any]) -> Callable[[Step], Counter[Any]]:
        def counts(step: Step) -> Counter[Any]:
            result: Counter[Any] = Counter()
            for item, n in step.ops.items():
                result[index(item)] += n
            return result

        return counts

    def nums(counts: list[int]) -> str:
        return "".join(f"{n:7d}" for n in counts)

    # 1. Per component.
    table = rows(ops_by(lambda item: (item[0], item[1])))
    width = max(len(component) for (_, component), _ in table)
    out.append(f"## 1. ops per decode step, per component (layers: instances; /layer: b={first} ops per instance)")
    out.append(f"{'where':8s}{'component':{width}s} {'layers':>6s}{cols}{'/layer':>8s}")
    for (where, component), counts in table:
        layers = len(decode[first].layers.get(component, ()))
        per_layer = f"{counts[0] / layers:8.1f}" if layers else ""
        out.append(f"{where:8s}{component:{width}s} {layers or '':>6}{nums(counts)}{per_layer}")
    for label, where in (("model (forward + logits)", "model"), ("outside the model", "outside"), ("TOTAL", None)):
        out.append(f"{'':8s}{label:{width}s} {'':6s}{nums([decode[b].total(where) for b in batches])}")
    tokens = " and ".join(str(prefill[b].num_tokens) for b in batches)
    label = f"(for scale: the prefill steps, {tokens} tokens)"
    out.append(f"{'':8s}{label:{width}s} {'':6s}{nums([prefill[b].total() for b in batches])}")

    # 2. Top (component, op).
    table = rows(ops_by(lambda item: (item[1], item[2])))[:top]
    width = max(len(component) for (component, _), _ in table)
    out += [
        "",
        f"## 2. top {top} (component, aten op) pairs per decode step",
        f"{'component':{width}s} {'op':22s}{cols}",
    ]
    out += [f"{component:{width}s} {op:22s}{nums(counts)}" for (component, op), counts in table]

    # 3. Top (component, issuing function).
    table = rows(ops_by(lambda item: (item[1], item[3])))[:top]
    width = max(len(component) for (component, _), _ in table)
    fwidth = max(len(function) for (_, function), _ in table)
    out += ["", f"## 3. top {top} (component, issuing function: the innermost vLLM / qwen38_plugin frame) pairs"]
    out.append(f"{'component':{width}s} {'function':{fwidth}s}{cols}")
    out += [f"{component:{width}s} {function:{fwidth}s}{nums(counts)}" for (component, function), counts in table]

    # 4. Outside the model, per source line.
    table = rows(lambda step: step.lines)
    out += ["", "## 4. outside the model, per source line (the innermost vLLM / qwen38_plugin frame) and op"]
    if table:
        lwidth = max(len(location) for (location, _, _), _ in table)
        fwidth = max(len(function) for (_, function, _), _ in table)
        out.append(f"{'line':{lwidth}s} {'function':{fwidth}s} {'op':22s}{cols}  code")
        for (location, function, op), counts in table:
            path, line = location.rsplit(":", 1)
            code = _source(path, int(line))
            out.append(f"{location:{lwidth}s} {function:{fwidth}s} {op:22s}{nums(counts)}  {code}")

    # 5. Host syncs.
    table = rows(lambda step: step.syncs)
    out += ["", "## 5. ops that read a value back to the host (on CUDA tensors: a sync per call), per decode step"]
    if not table:
        out.append("(none)")
    else:
        width = max(len(component) for (_, component, _), _ in table)
        lwidth = max(len(location) for (_, _, location), _ in table)
        out.append(f"{'component':{width}s} {'line':{lwidth}s} {'op':20s}{cols}")
        for (op, component, location), counts in table:
            out.append(f"{component:{width}s} {location:{lwidth}s} {op:20s}{nums(counts)}")
    return "\n".join(out)


def _source(path: str, line: int) -> str:
    """The stripped code of ``path:line`` (``vllm/...`` or ``qwen38_plugin/...``), at most 100 characters."""
    import importlib.util

    package = path.split("/", 1)[0]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return ""
    base = Path(next(iter(spec.submodule_search_locations))).parent
    return linecache.getline(str(base / path), line).strip()[:100]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=list(bench_cpu.CONFIGS), default="medium")
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: bench_cpu.py's of --config)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument(
        "--qsa-triton", action="store_true", help="run QSA's ops on their Triton (CUDA) path, interpreted"
    )
    parser.add_argument(
        "--speculative", choices=["mtp", "dflash", "none"], help="a verify step (random drafts) with this drafter"
    )
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--top", type=int, default=40, help="rows of the pair tables")
    parser.add_argument("--out", type=Path, help="also write the tables here")
    args = parser.parse_args()
    start = time.perf_counter()
    decode, prefill, notes = run(args)
    text = tables(decode, prefill, args.top)
    notes.append(f"wall time {time.perf_counter() - start:.0f} s")
    print(text)
    print("\n".join(f"# {note}" for note in notes))
    if args.out:
        command = " ".join([".venv/bin/python tests/engines.py .venv/bin/python", *sys.argv])
        machine = f"{os.cpu_count()} CPUs, torch {torch_version()}, vLLM {vllm_version()}"
        header = [
            f"command: {command}",
            f"date: {datetime.date.today().isoformat()}; {machine}",
            f"{args.config} config, {args.dtype}, {args.prompt_len}-token prompts, max_tokens=2, enforce_eager, "
            "in-process engine",
            *notes,
            "",
            *HEADER.strip().splitlines(),
        ]
        args.out.write_text("\n".join([*(f"# {line}".rstrip() for line in header), "", text, ""]))


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


if __name__ == "__main__":
    main()
