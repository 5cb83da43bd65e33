"""The served model (`qwen38_plugin.vllm_model`) built in this process from vLLM's layers.

- torch.compile traces its forward as one graph (``fullgraph=True``, dynamic token count), the
  stateful blocks as opaque vLLM custom ops: what vLLM's `support_torch_compile` needs on CUDA
  (the CPU platform runs vLLM uncompiled, so this is the only place the CPU can check it);
- a forward dispatches the same aten ops for 2 and for 13 tokens, and the custom ops take the
  same arguments: nothing in the model loops over tokens or requests;
- the custom ops are among vLLM's splitting ops (outside piecewise CUDA graphs);
- the QSA op with CUDA-graph padding rows after the real tokens computes and stores what it
  does without them (the failure the H200 run found).

The first two run without a step's metadata (as vLLM's profiling run): the custom ops then write zeros.
The engine tests check what the model computes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Callable[..., Path], vllm_single_rank: None) -> Iterator[tuple[Any, Any]]:
    """(the built model, its VllmConfig) for the tiny fp32 checkpoint, weights loaded."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from qwen38_plugin import register
    from qwen38_plugin.model import iter_safetensors
    from qwen38_plugin.vllm_model import PortableQwen4ExpForCausalLM

    register()
    model_dir = tiny_checkpoint("qwen4_exp_text", dtype="float32")
    config = EngineArgs(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256)
    vllm_config = config.create_engine_config()
    with pytest.MonkeyPatch.context() as env, set_current_vllm_config(vllm_config):
        env.setenv("QWEN38_PLE_TABLE", "device")  # no shared-memory segment for a model that never loads
        model = initialize_model(vllm_config, model_class=PortableQwen4ExpForCausalLM)
        model.load_weights(iter_safetensors(model_dir))
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    assert isinstance(model, PortableQwen4ExpForCausalLM)
    yield model, vllm_config


def _inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 248_000, (n,)), torch.arange(n)


def test_forward_traces_as_one_graph(served: tuple[Any, Any]) -> None:
    from vllm.forward_context import set_forward_context

    model, vllm_config = served
    torch._dynamo.reset()
    compiled = torch.compile(model.model.forward, fullgraph=True, backend="eager", dynamic=True)
    with set_forward_context(None, vllm_config), torch.no_grad():
        for n in (5, 9):
            ids, positions = _inputs(n)
            out = compiled(ids, positions)
            assert out.shape == (n, model.config.hidden_size) and bool(torch.isfinite(out).all())
            assert torch.equal(out, model.model.forward(ids, positions))


class _OpRecorder(TorchDispatchMode):
    """Counts the aten / custom ops a forward dispatches at the top level (not inside our ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self._inside = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if self._inside == 0:
            self.ops[name] += 1
        custom = name.startswith("vllm.qwen38_")
        self._inside += custom
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self._inside -= custom


def test_forward_dispatches_the_same_ops_for_any_token_count(served: tuple[Any, Any]) -> None:
    from vllm.forward_context import set_forward_context

    model, vllm_config = served
    counts = []
    with set_forward_context(None, vllm_config), torch.no_grad():
        # (2 and 13: a single row is contiguous where more rows are not, so `.contiguous()` of a
        # split copies for more rows only; that is shape, not a loop)
        for n in (2, 13):
            recorder = _OpRecorder()
            with recorder:
                model.model.forward(*_inputs(n))
            counts.append(recorder.ops)
    assert counts[0] == counts[1]
    assert counts[0]["vllm.qwen38_qsa_attention"] == model.config.layer_types.count("indexed_attention")
    assert counts[0]["vllm.qwen38_ple_mix"] == len(model.config.ple_layer_ids)
    # nothing reads a tensor back to the host
    assert not {"aten._local_scalar_dense", "aten.item", "aten.nonzero"} & set(counts[0])


def test_custom_ops_split_vllm_piecewise_graphs(served: tuple[Any, Any]) -> None:
    """Our ops read per-request metadata, so vLLM must run them between its piecewise CUDA graphs
    (as it runs its own attention and GDN ops), never inside one replayed for a prefill batch."""
    from qwen38_plugin.vllm_ops import SPLITTING_OPS

    _, vllm_config = served
    splitting = vllm_config.compilation_config.splitting_ops
    assert splitting is not None
    assert set(SPLITTING_OPS) <= set(splitting)
    assert len(splitting) == len(set(splitting))  # registered once, whatever the number of layers


MAX_PAD = 11


def _qsa_step(
    model: Any, vllm_config: Any, tokens: int, pad: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One prefill step of two requests through the first QSA layer's op (`attend`), on fresh
    caches, with ``pad`` extra rows (vLLM's CUDA-graph padding) after the real tokens: returns
    the op's output rows and the three caches afterwards."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from qwen38_plugin.vllm_qsa import PortableQSAAttention
    from qwen38_plugin.vllm_qsa_cache import QSAMetadataBuilder

    attn = next(m for m in model.modules() if isinstance(m, PortableQSAAttention))
    cache = attn.cache
    assert cache.block_keys is not None and cache.ring is not None
    block_size = vllm_config.cache_config.block_size
    lens = [tokens - tokens // 3, tokens // 3]
    qsl = torch.tensor([0, lens[0], tokens], dtype=torch.int32)
    blocks_per_req = -(-max(lens) // block_size)
    block_table = torch.arange(1, 1 + 2 * blocks_per_req, dtype=torch.int32).view(2, blocks_per_req)
    positions = torch.cat([torch.arange(n) for n in lens])
    req = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    slot_mapping = (block_table[req, positions // block_size] * block_size + positions % block_size).long()
    gen = torch.Generator().manual_seed(seed)
    d, hq, hkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    assert attn.indexer is not None, "the tiny checkpoint's QSA layers have an indexer"
    di = attn.indexer.head_dim
    ring_rows, ratio = cache.ring.capacity, cache.ratio
    layers = {
        cache.prefix: (cache, torch.zeros(1 + 2 * blocks_per_req, hkv, block_size, 2 * d)),
        cache.block_keys.prefix: (cache.block_keys, torch.zeros(1 + 2 * blocks_per_req, 1, block_size // ratio, di)),
        cache.ring.prefix: (cache.ring, torch.zeros(3, 1, ring_rows, di)),
    }
    tables = {cache.prefix: block_table, cache.block_keys.prefix: block_table,
              cache.ring.prefix: torch.tensor([[1], [2]], dtype=torch.int32)}  # fmt: skip
    metadata = {}
    for name, (layer, tensor) in layers.items():
        layer.bind_kv_cache(tensor)
        spec = layer.get_kv_cache_spec(vllm_config)
        builder = QSAMetadataBuilder(spec, [name], vllm_config, torch.device("cpu"))
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
            num_reqs=2, num_actual_tokens=tokens, max_query_len=max(lens), max_seq_len=max(lens),
            block_table_tensor=tables[name], slot_mapping=slot_mapping if name == cache.prefix else slot_mapping * 0,
        )  # fmt: skip
        if pad:  # a step padded for a CUDA graph after a larger one: stale values must not be read
            builder._slots.fill_(3)
            builder._token_req.fill_(0)
        metadata[name] = builder.build(0, common)
    rows, drawn = tokens + pad, tokens + MAX_PAD  # the same draws whatever the padding
    q = torch.randn(drawn, hq, d, generator=gen)[:rows]
    gate = torch.randn(drawn, hq * d, generator=gen)[:rows]
    k, v = torch.randn(drawn, hkv, d, generator=gen)[:rows], torch.randn(drawn, hkv, d, generator=gen)[:rows]
    assert attn.indexer is not None
    index_q = torch.randn(drawn, attn.indexer.num_heads, di, generator=gen)[:rows]
    raw_keys = torch.randn(drawn, di, generator=gen)[:rows]
    all_positions = torch.cat([positions, torch.zeros(pad, dtype=torch.long)])
    out = torch.full((rows, hq * d), float("nan"))
    with set_forward_context(metadata, vllm_config), torch.no_grad():
        attn.attend(q, gate, k, v, index_q, raw_keys, all_positions, out)
    return out, [tensor.clone() for _, tensor in layers.values()]


def test_draft_decode_metadata_update_equals_a_fresh_build(served: tuple[Any, Any]) -> None:
    """vLLM's V2 speculators advance a draft step's inputs in place (sequence lengths, the K/V slot
    mapping) and call `update_draft_decode_metadata` instead of `build`, inside one CUDA graph for
    every draft step after the first: for each of the three QSA caches the updated metadata equals
    a fresh build's from the advanced inputs, step after step, in the same buffers."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from qwen38_plugin.vllm_qsa import PortableQSAAttention
    from qwen38_plugin.vllm_qsa_cache import QSAMetadataBuilder

    model, vllm_config = served
    cache = next(m for m in model.modules() if isinstance(m, PortableQSAAttention)).cache
    assert cache.block_keys is not None and cache.ring is not None
    block_size = vllm_config.cache_config.block_size
    # three requests decoding one token each; lengths cross a block boundary and close index groups
    lens = torch.tensor([block_size - 2, 5, 2 * block_size - 1], dtype=torch.int32)
    qsl = torch.arange(4, dtype=torch.int32)
    block_table = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.int32)
    ring_table = torch.tensor([[1], [2], [3]], dtype=torch.int32)

    def kv_slots(seq_lens: torch.Tensor) -> torch.Tensor:
        positions = seq_lens.long() - 1
        return (block_table[torch.arange(3), positions // block_size] * block_size + positions % block_size).long()

    def fields(meta: Any) -> list[torch.Tensor]:
        return [meta.token_req.clone(), meta.step_start.clone(), meta.slots.clone(), meta.positions.clone()]

    for layer in (cache, cache.block_keys, cache.ring):
        table = ring_table if layer is cache.ring else block_table
        seq_lens, slot_mapping = lens.clone(), kv_slots(lens)  # the speculator's persistent buffers

        def common(seq: torch.Tensor, slots: torch.Tensor, table: torch.Tensor = table) -> Any:
            return CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=3, num_actual_tokens=3,
                max_query_len=1, max_seq_len=int(seq.max()), block_table_tensor=table, slot_mapping=slots,
            )  # fmt: skip

        spec = layer.get_kv_cache_spec(vllm_config)
        builder = QSAMetadataBuilder(spec, [layer.prefix], vllm_config, torch.device("cpu"))
        metadata = builder.build(0, common(seq_lens, slot_mapping))
        for _ in range(3):  # draft steps: one more token each
            seq_lens += 1
            slot_mapping.copy_(kv_slots(seq_lens))
            before = fields(metadata)
            builder.update_draft_decode_metadata(metadata)
            fresh = QSAMetadataBuilder(spec, [layer.prefix], vllm_config, torch.device("cpu"))
            expected = fields(fresh.build(0, common(seq_lens.clone(), slot_mapping.clone())))
            for got, want in zip(fields(metadata), expected, strict=True):
                assert torch.equal(got, want), layer.prefix
            assert not torch.equal(before[3], expected[3])  # the positions moved: the update did the work


def test_draft_metadata_update_switch(served: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from qwen38_plugin.vllm_qsa import PortableQSAAttention
    from qwen38_plugin.vllm_qsa_cache import DRAFT_UPDATE_ENV, QSAMetadataBuilder

    model, vllm_config = served
    cache = next(m for m in model.modules() if isinstance(m, PortableQSAAttention)).cache
    spec = cache.get_kv_cache_spec(vllm_config)

    def builder() -> QSAMetadataBuilder:
        return QSAMetadataBuilder(spec, [cache.prefix], vllm_config, torch.device("cpu"))

    assert builder().supports_draft_decode_metadata_update
    monkeypatch.setenv(DRAFT_UPDATE_ENV, "0")
    assert not builder().supports_draft_decode_metadata_update
    monkeypatch.setenv(DRAFT_UPDATE_ENV, "yes")
    with pytest.raises(ValueError, match="QWEN38_QSA_DRAFT_UPDATE='yes': set it to 1 \\(the default\\) or 0"):
        builder()


def test_qsa_op_ignores_cuda_graph_padding_rows(served: tuple[Any, Any]) -> None:
    """vLLM pads a step's tokens to a CUDA-graph size while the metadata covers the real ones
    (found on an H200): the padded rows change nothing the real rows see or store, and get zeros."""
    model, vllm_config = served
    tokens = 37
    plain_out, plain_caches = _qsa_step(model, vllm_config, tokens, pad=0, seed=3)
    padded_out, padded_caches = _qsa_step(model, vllm_config, tokens, pad=MAX_PAD, seed=3)
    assert torch.isfinite(plain_out).all()
    assert torch.equal(padded_out[tokens:], torch.zeros_like(padded_out[tokens:]))
    for plain, padded in zip(plain_caches, padded_caches, strict=True):
        assert torch.equal(plain, padded)
    assert torch.equal(plain_out, padded_out[:tokens])
