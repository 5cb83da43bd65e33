"""`ops.ple_varlen` (PLE of a whole engine step on vLLM's state slots) against the reference
`ops.ple` run request by request over several steps, and its graph safety: no host syncs, no
ops that grow with the number of requests, shapes from shapes alone (meta tensors), and a CUDA
graph replay where a GPU is present."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from qwen38_plugin.ops import ple
from qwen38_plugin.ops.ple_varlen import ngram_rows_varlen, ple_mix_varlen, token_requests
from tests.qwen38_plugin.qwen38_reference import rel_err

HC, HIDDEN, NGRAM, HEADS_PER_NGRAM, KERNEL = 2, 8, 3, 2, 4
WIDTH, SPAN = HC * HIDDEN, (KERNEL - 1) * NGRAM
HEAD_VOCAB_SIZES = [101, 103, 107, 109]  # (n - 1) * heads_per_ngram primes
EMBED_PER_HEAD = 3
EOS = 7
TOKEN_RANGE = 40  # small: EOS also turns up by chance
SLOTS = 16
EPS = 1e-6
# fp32: batched and per-request projections and convs sum in other orders (seen: 2.2e-7).
FP32_TOL = 1e-6
# Half precisions: the same rounding points as the reference (seen: no difference at all); two
# ulps of the format for a projection of a batch rounding otherwise than that of one request.
HALF_TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


@dataclass
class Weights:
    table: torch.Tensor
    multipliers: torch.Tensor
    head_vocab_sizes: torch.Tensor
    head_offsets: torch.Tensor
    key_proj: torch.Tensor
    value_proj: torch.Tensor
    norm_key: torch.Tensor
    norm_query: torch.Tensor
    norm_conv: torch.Tensor
    conv: torch.Tensor


def _weights(dtype: torch.dtype, gen: torch.Generator, device: str = "cpu") -> Weights:
    sizes = torch.tensor(HEAD_VOCAB_SIZES)
    embed = len(HEAD_VOCAB_SIZES) * EMBED_PER_HEAD

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    return Weights(
        table=randn(int(sizes.sum()), EMBED_PER_HEAD),
        # full-range multipliers: the hashes overflow and must wrap as the reference's do
        multipliers=torch.randint(-(2**62), 2**62, (NGRAM,), generator=gen).to(device),
        head_vocab_sizes=sizes.to(device),
        head_offsets=(sizes.cumsum(0) - sizes).to(device),
        key_proj=randn(WIDTH, embed),
        value_proj=randn(HIDDEN, embed),
        norm_key=randn(WIDTH) * 0.1,
        norm_query=randn(WIDTH) * 0.1,
        norm_conv=randn(WIDTH) * 0.1,
        conv=randn(WIDTH, KERNEL) * 0.5,
    )


def _caches(dtype: torch.dtype, gen: torch.Generator, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random context and conv caches, each a strided view into a wider buffer (as vLLM binds them)."""
    context_buf = torch.randint(0, TOKEN_RANGE, (SLOTS, NGRAM - 1 + 3), generator=gen).to(device)
    conv_buf = torch.randn(SLOTS, WIDTH * SPAN + 5, generator=gen).to(dtype=dtype, device=device)
    context, conv = context_buf[:, 1:NGRAM], conv_buf[:, 2 : 2 + WIDTH * SPAN].view(SLOTS, WIDTH, SPAN)
    assert not context.is_contiguous() and not conv.is_contiguous()
    return context, conv


@dataclass
class Entry:
    """One request row of a step."""

    name: str | None  # the sequence (None: padding)
    tokens: list[int]
    slot: int  # -1: PAD_SLOT_ID
    continues: bool = True


@dataclass
class Step:
    entries: list[Entry]
    trailing: int = 0  # padded token rows after the step's tokens (token_req = -1)

    @property
    def num_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries) + self.trailing

    def layout(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        """The per-step inputs, built here by plain Python (not by the code under test)."""
        token_ids: list[int] = []
        token_req: list[int] = []
        starts: list[int] = []
        for r, entry in enumerate(self.entries):
            starts.append(len(token_ids))
            token_ids += entry.tokens
            token_req += [r] * len(entry.tokens)
        token_ids += [0] * self.trailing
        token_req += [-1] * self.trailing
        return {
            "token_ids": torch.tensor(token_ids, dtype=torch.long, device=device),
            "token_req": torch.tensor(token_req, dtype=torch.int32, device=device),
            "query_start": torch.tensor(starts, dtype=torch.int32, device=device),
            "state_indices": torch.tensor([e.slot for e in self.entries], dtype=torch.int32, device=device),
            "has_initial_state": torch.tensor([e.continues for e in self.entries], device=device),
        }


def _ours(w: Weights, step: Step, streams: torch.Tensor, context: torch.Tensor, conv: torch.Tensor) -> dict[str, Any]:
    """The model's composition of the stages over one step: rows, lookup, projections, mix."""
    lay = step.layout(streams.device.type)
    meta = (lay["token_req"], lay["query_start"])
    slots = (lay["state_indices"], lay["has_initial_state"])
    rows = ngram_rows_varlen(
        lay["token_ids"], *meta, context, *slots, w.multipliers, w.head_vocab_sizes, w.head_offsets,
        heads_per_ngram=HEADS_PER_NGRAM, eos_token_id=EOS,
    )  # fmt: skip
    embedded = F.embedding(rows, w.table).flatten(-2)
    key, value = F.linear(embedded, w.key_proj), F.linear(embedded, w.value_proj)
    padding = lay["token_req"] < 0
    key, value = key.masked_fill(padding[:, None], float("nan")), value.masked_fill(padding[:, None], float("nan"))
    term = ple_mix_varlen(
        streams, key, value, w.norm_key, w.norm_query, w.norm_conv, w.conv, conv, *meta, *slots,
        hc_count=HC, ngram_size=NGRAM, eps=EPS,
    )  # fmt: skip
    return {"rows": rows, "term": term}


@dataclass
class Reference:
    """`ple.ple` per sequence, carrying its own states from step to step."""

    w: Weights
    context: dict[str, torch.Tensor] = field(default_factory=dict)
    conv: dict[str, torch.Tensor] = field(default_factory=dict)

    def run(self, name: str, ids: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(term [T, hc * H], rows [T, heads]) of a sequence's next tokens."""
        w = self.w
        context = self.context.get(name, ple.initial_context(1, NGRAM, EOS))
        rows, _ = ple.ngram_ids(
            ids[None], context, w.multipliers, w.head_vocab_sizes, w.head_offsets,
            heads_per_ngram=HEADS_PER_NGRAM, eos_token_id=EOS,
        )  # fmt: skip
        term, self.context[name], self.conv[name] = ple.ple(
            streams[None], ids[None], w.table, w.multipliers, w.head_vocab_sizes, w.head_offsets, w.key_proj,
            w.value_proj, w.norm_key, w.norm_query, w.norm_conv, w.conv, hc_count=HC,
            heads_per_ngram=HEADS_PER_NGRAM, eos_token_id=EOS, eps=EPS, context=self.context.get(name),
            conv_state=self.conv.get(name),
        )  # fmt: skip
        return term[0], rows[0]


def _tokens(n: int, gen: torch.Generator, eos_at: tuple[int, ...] = ()) -> list[int]:
    ids = torch.randint(0, TOKEN_RANGE, (n,), generator=gen)
    ids[ids == EOS] = EOS + 1  # EOS only where placed
    for i in eos_at:
        ids[i] = EOS
    return ids.tolist()


def _plan(gen: torch.Generator) -> list[Step]:
    """Four steps of four sequences in shuffled slots, with EOS inside prompts and at step boundaries."""
    return [
        Step(
            [
                Entry("A", _tokens(6, gen, eos_at=(2,)), 9, continues=False),
                Entry("B", _tokens(1, gen), 3, continues=False),
                Entry(None, _tokens(3, gen), -1),  # PAD_SLOT_ID: its tokens are padding
                Entry("C", _tokens(12, gen, eos_at=(11,)), 12, continues=False),  # ends on EOS
            ],
            trailing=2,
        ),
        Step(
            [
                Entry("B", _tokens(1, gen, eos_at=(0,)), 3),  # a decode of EOS
                Entry("A", _tokens(4, gen, eos_at=(0,)), 9),  # a chunk starting on EOS
                Entry("C", _tokens(1, gen), 12),
                Entry("D", _tokens(7, gen, eos_at=(0, 5)), 5, continues=False),
                # a padded request on the null block: no tokens; vLLM flags it fresh (no computed tokens)
                Entry(None, [], 0, continues=False),
            ]
        ),
        Step(
            [
                Entry("D", _tokens(1, gen), 5),
                Entry("C", _tokens(3, gen, eos_at=(1,)), 12),
                Entry("A", _tokens(1, gen), 9),
                Entry("B", _tokens(1, gen), 3),
            ],
            trailing=3,
        ),
        Step([Entry(name, _tokens(1, gen), slot) for name, slot in (("C", 12), ("A", 9), ("D", 5), ("B", 3))]),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_steps_match_reference_per_request(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w = _weights(dtype, gen)
    context, conv = _caches(dtype, gen)
    fresh_slots = {9, 3, 12, 5}
    conv[sorted(fresh_slots)] = float("nan")  # garbage a fresh request must not read
    ref = Reference(w)
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL[dtype]
    history: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    for step in _plan(gen):
        streams = torch.randn(step.num_tokens, WIDTH, generator=gen).to(dtype)
        lay = step.layout()
        padding = lay["token_req"] < 0
        for r, entry in enumerate(step.entries):
            if entry.name is None:
                padding[lay["token_req"] == r] = True
        streams[padding] = float("nan")  # padding rows may hold anything
        context_before, conv_before = context.clone(), conv.clone()

        ours = _ours(w, step, streams, context, conv)

        assert torch.equal(ours["term"][padding], torch.zeros_like(ours["term"][padding]))
        assert torch.equal(ours["rows"][padding], torch.zeros_like(ours["rows"][padding]))
        for r, entry in enumerate(step.entries):
            if entry.name is None:
                continue
            mine = lay["token_req"] == r
            expected, expected_rows = ref.run(entry.name, lay["token_ids"][mine], streams[mine])
            assert torch.equal(ours["rows"][mine], expected_rows)
            assert rel_err(ours["term"][mine], expected) < tol
            assert torch.equal(context[entry.slot], ref.context[entry.name][0])
            assert rel_err(conv[entry.slot], ref.conv[entry.name][0]) < tol
            history.setdefault(entry.name, []).append((lay["token_ids"][mine], streams[mine], ours["term"][mine]))
        written = {e.slot for e in step.entries if e.name is not None}
        for slot in set(range(SLOTS)) - written:  # the null block 0 and the padding's slots included
            assert torch.equal(context[slot], context_before[slot])
            assert torch.equal(conv[slot].view(torch.uint8), conv_before[slot].view(torch.uint8))

    if dtype == torch.float32:
        # The steps together equal one reference run over each whole sequence.
        for name, pieces in history.items():
            ids, streams, terms = (torch.cat(p) for p in zip(*pieces, strict=True))
            whole = Reference(w).run(name, ids, streams)[0]
            assert rel_err(terms, whole) < FP32_TOL


def test_no_flags_means_every_request_continues() -> None:
    # has_initial_state=None (vLLM's step without prefills): the slots' states are used.
    gen = torch.Generator().manual_seed(1)
    w = _weights(torch.float32, gen)
    context, conv = _caches(torch.float32, gen)
    step = Step([Entry("A", _tokens(1, gen), 4), Entry("B", _tokens(1, gen), 11)])
    streams = torch.randn(2, WIDTH, generator=gen)
    lay = step.layout()
    expected = [
        ple.ple(
            streams[None, r : r + 1], lay["token_ids"][None, r : r + 1], w.table, w.multipliers, w.head_vocab_sizes,
            w.head_offsets, w.key_proj, w.value_proj, w.norm_key, w.norm_query, w.norm_conv, w.conv, hc_count=HC,
            heads_per_ngram=HEADS_PER_NGRAM, eos_token_id=EOS, eps=EPS, context=context[slot][None].clone(),
            conv_state=conv[slot][None].clone(),
        )[0][0]
        for r, slot in enumerate((4, 11))
    ]  # fmt: skip
    rows = ngram_rows_varlen(
        lay["token_ids"], lay["token_req"], lay["query_start"], context, lay["state_indices"], None,
        w.multipliers, w.head_vocab_sizes, w.head_offsets, heads_per_ngram=HEADS_PER_NGRAM, eos_token_id=EOS,
    )  # fmt: skip
    embedded = F.embedding(rows, w.table).flatten(-2)
    term = ple_mix_varlen(
        streams, F.linear(embedded, w.key_proj), F.linear(embedded, w.value_proj), w.norm_key, w.norm_query,
        w.norm_conv, w.conv, conv, lay["token_req"], lay["query_start"], lay["state_indices"], None,
        hc_count=HC, ngram_size=NGRAM, eps=EPS,
    )  # fmt: skip
    assert rel_err(term, torch.cat(expected)) < FP32_TOL


def test_padding_never_clobbers_a_request_in_slot_0() -> None:
    # A negative slot reads as slot 0 (clamped) and every row of a step is written (static
    # shapes): the padding rows, first and last here, must not overwrite a request that really
    # lives in slot 0.
    gen = torch.Generator().manual_seed(2)
    w = _weights(torch.float32, gen)
    context, conv = _caches(torch.float32, gen)
    step = Step(
        [
            Entry(None, _tokens(2, gen), -1),
            Entry("A", _tokens(3, gen), 0, continues=False),
            Entry("B", _tokens(1, gen), 8, continues=False),
            Entry(None, _tokens(1, gen), -1),
        ]
    )
    streams = torch.randn(step.num_tokens, WIDTH, generator=gen)
    lay = step.layout()
    ours = _ours(w, step, streams, context, conv)
    ref = Reference(w)
    for r, (name, slot) in enumerate((("A", 0), ("B", 8)), start=1):
        mine = lay["token_req"] == r
        expected, _ = ref.run(name, lay["token_ids"][mine], streams[mine])
        assert rel_err(ours["term"][mine], expected) < FP32_TOL
        assert torch.equal(context[slot], ref.context[name][0])
        assert rel_err(conv[slot], ref.conv[name][0]) < FP32_TOL


def test_token_requests() -> None:
    # vLLM's query_start_loc with an empty request inside, two padded requests at the end (as in a
    # padded CUDA-graph batch) and padded token rows past the last request.
    query_start_loc = torch.tensor([0, 3, 3, 4, 9, 9, 9], dtype=torch.int32)
    expected = [0, 0, 0, 2, 3, 3, 3, 3, 3, -1, -1]
    assert token_requests(query_start_loc, 11).tolist() == expected
    assert token_requests(query_start_loc, 11).dtype == torch.int32


# -- graph safety ------------------------------------------------------------------------------

# aten ops that read a tensor's value on the host (a sync on CUDA, and no CUDA-graph capture) or
# whose output shape depends on values.
HOST_SYNC_OPS = {
    "aten._local_scalar_dense",
    "aten.item",
    "aten.is_nonzero",
    "aten.equal",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.unique_dim",
}


# Indexing with a boolean mask is one aten.index call whose output size is the mask's count
# (its nonzero runs inside the op, below the dispatch mode): recorded under this name.
MASK_INDEX = "aten.index with a boolean mask"


class _OpRecorder(TorchDispatchMode):
    """Records the name of every aten op dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None
        ):
            name = MASK_INDEX
        self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _decode_step(num_requests: int, gen: torch.Generator) -> Step:
    """A padded CUDA-graph decode batch: decodes (one fresh), then padded requests on the null block."""
    entries = [Entry(f"s{r}", _tokens(1, gen), 1 + r, continues=r != 1) for r in range(num_requests)]
    return Step([*entries, Entry(None, [], 0, False), Entry(None, [], 0, False)], trailing=2)


def _mixed_step(num_requests: int, gen: torch.Generator) -> Step:
    """Decodes and prefills of 1..12 tokens, fresh and continuing, a PAD_SLOT_ID request and padding."""
    entries = [
        Entry(f"s{r}", _tokens(1 + (5 * r) % 12, gen, eos_at=(0,)), 1 + r, continues=r % 2 == 0)
        for r in range(num_requests)
    ]
    return Step([*entries, Entry(None, _tokens(2, gen), -1), Entry(None, [], 0, False)], trailing=1)


def _run_ops(
    w: Weights, step: Step, streams: torch.Tensor, context: torch.Tensor, conv: torch.Tensor, recorder: _OpRecorder
) -> torch.Tensor:
    """The three ops of a step as the model calls them (the recorder sees only them, not the caller's
    lookup and projections)."""
    lay = step.layout(streams.device.type)
    lengths = torch.tensor([0] + [len(e.tokens) for e in step.entries])
    query_start_loc = lengths.cumsum(0).to(device=streams.device, dtype=torch.int32)
    with recorder:
        token_req = token_requests(query_start_loc, streams.shape[0])
        query_start = query_start_loc[:-1]
        rows = ngram_rows_varlen(
            lay["token_ids"], token_req, query_start, context, lay["state_indices"], lay["has_initial_state"],
            w.multipliers, w.head_vocab_sizes, w.head_offsets, heads_per_ngram=HEADS_PER_NGRAM, eos_token_id=EOS,
        )  # fmt: skip
    embedded = F.embedding(rows, w.table).flatten(-2)
    key, value = F.linear(embedded, w.key_proj), F.linear(embedded, w.value_proj)
    with recorder:
        return ple_mix_varlen(
            streams, key, value, w.norm_key, w.norm_query, w.norm_conv, w.conv, conv, token_req, query_start,
            lay["state_indices"], lay["has_initial_state"], hc_count=HC, ngram_size=NGRAM, eps=EPS,
        )  # fmt: skip


def test_recorder_sees_host_syncs() -> None:
    # The checks below are only as good as the recorder: it must see a value read on the host and
    # a value-dependent shape.
    recorder = _OpRecorder()
    t = torch.arange(3)
    with recorder:
        t.sum().item()
        t[t > 0].sum()
    assert "aten._local_scalar_dense" in recorder.ops
    assert MASK_INDEX in recorder.ops


@pytest.mark.parametrize("make_step", [_decode_step, _mixed_step], ids=["decode", "mixed"])
def test_no_host_sync_and_op_count_independent_of_requests(make_step: Callable[[int, torch.Generator], Step]) -> None:
    gen = torch.Generator().manual_seed(3)
    w = _weights(torch.float32, gen)
    counts = []
    for num_requests in (2, 7):
        step = make_step(num_requests, gen)
        context, conv = _caches(torch.float32, gen)
        streams = torch.randn(step.num_tokens, WIDTH, generator=gen)
        recorder = _OpRecorder()
        _run_ops(w, step, streams, context, conv, recorder)
        syncs = (HOST_SYNC_OPS | {MASK_INDEX}) & set(recorder.ops)
        assert not syncs, sorted(syncs)
        counts.append(Counter(recorder.ops))
    # batched: the same ops, as often, for 2 requests as for 7
    assert counts[0] == counts[1]


def test_shapes_follow_from_shapes_alone() -> None:
    # On the meta device no value exists: any op that needs one (a sync, a value-dependent
    # shape) raises. The caches are updated in place, so their shapes must come back unchanged.
    gen = torch.Generator().manual_seed(4)
    w = _weights(torch.float32, gen, device="meta")
    context, conv = _caches(torch.float32, gen, device="meta")
    step = _plan(gen)[1]
    streams = torch.empty(step.num_tokens, WIDTH, device="meta")
    term = _run_ops(w, step, streams, context, conv, _OpRecorder())
    assert term.shape == (step.num_tokens, WIDTH) and term.device.type == "meta"
    assert context.shape == (SLOTS, NGRAM - 1) and conv.shape == (SLOTS, WIDTH, SPAN)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_matches_eager(dtype: torch.dtype) -> None:
    # One captured step (static shapes: 6 request rows, 9 token rows) replayed with other
    # requests, lengths, slots and padding each time equals the eager ops on CPU.
    gen = torch.Generator().manual_seed(5)
    w_cpu = _weights(dtype, gen)
    w = Weights(**{k: v.cuda() for k, v in vars(w_cpu).items()})
    context_cpu, conv_cpu = _caches(dtype, gen)
    context, conv = context_cpu.cuda(), conv_cpu.cuda()
    steps = [
        Step([Entry("a", _tokens(3, gen, (1,)), 4, False), Entry("b", _tokens(1, gen), 9, False),
              Entry("c", _tokens(2, gen), 2, False), Entry(None, _tokens(1, gen), -1),
              Entry("d", _tokens(2, gen), 13, False), Entry(None, [], 0)]),
        Step([Entry("d", _tokens(1, gen, (0,)), 13), Entry("a", _tokens(1, gen), 4), Entry("b", _tokens(4, gen), 9),
              Entry("c", _tokens(1, gen), 2), Entry(None, [], 0), Entry(None, [], 0)], trailing=2),
        Step([Entry("b", _tokens(1, gen), 9), Entry("c", _tokens(1, gen), 2), Entry("e", _tokens(5, gen), 6, False),
              Entry("a", _tokens(1, gen), 4), Entry("d", _tokens(1, gen), 13), Entry(None, [], 0)]),
    ]  # fmt: skip
    assert all(s.num_tokens == 9 and len(s.entries) == 6 for s in steps)

    def inputs(step: Step) -> dict[str, torch.Tensor]:
        lay = step.layout()
        lengths = torch.tensor([0] + [len(e.tokens) for e in step.entries])
        lay["query_start_loc"] = lengths.cumsum(0).to(torch.int32)
        lay["streams"] = torch.randn(9, WIDTH, generator=gen).to(dtype)
        return lay

    static = {k: v.cuda() for k, v in inputs(steps[0]).items()}

    def run(x: dict[str, torch.Tensor], w: Weights, context: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
        token_req = token_requests(x["query_start_loc"], x["token_ids"].shape[0])
        query_start = x["query_start_loc"][:-1]
        slots = (x["state_indices"], x["has_initial_state"])
        rows = ngram_rows_varlen(
            x["token_ids"], token_req, query_start, context, *slots, w.multipliers, w.head_vocab_sizes,
            w.head_offsets, heads_per_ngram=HEADS_PER_NGRAM, eos_token_id=EOS,
        )  # fmt: skip
        embedded = F.embedding(rows, w.table).flatten(-2)
        return ple_mix_varlen(
            x["streams"], F.linear(embedded, w.key_proj), F.linear(embedded, w.value_proj), w.norm_key,
            w.norm_query, w.norm_conv, w.conv, conv, token_req, query_start, *slots, hc_count=HC,
            ngram_size=NGRAM, eps=EPS,
        )  # fmt: skip

    saved = context.clone(), conv.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as vLLM does
        run(static, w, context, conv)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        term = run(static, w, context, conv)
    context.copy_(saved[0])
    conv.copy_(saved[1])
    for step in steps:
        x = inputs(step)
        for k, v in x.items():
            static[k].copy_(v)
        graph.replay()
        expected = run(x, w_cpu, context_cpu, conv_cpu)
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # CUDA and CPU kernels round differently
        assert rel_err(term.cpu(), expected) < tol
        assert torch.equal(context.cpu(), context_cpu)
        assert rel_err(conv.cpu(), conv_cpu) < tol
