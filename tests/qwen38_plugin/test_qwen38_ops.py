"""Each plain-torch op against the matching transformers Qwen4Exp module, and streaming forms
(chunked prefill continuing from a state, single-step decode) against the full-sequence form."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from qwen38_plugin.ops import gdn, hyper_connection, moe, ple, qsa
from qwen38_plugin.ops.common import causal_conv1d
from tests.qwen38_plugin.qwen38_reference import load_reference, rel_err

# fp32 results must agree with the reference to this relative error (max-abs / max-abs).
FP32_TOL = 2e-5
# Half precisions: our op in dtype X against transformers in dtype X, both from the same
# weights. Each rounds intermediate values at slightly different points, so the tolerance is a
# few units of the format's precision (bf16 has 8 mantissa bits, fp16 11).
HALF_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}

EOS = 248046


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen4_exp_text")


@pytest.fixture(scope="module")
def hf32(checkpoint: Path) -> Any:
    return load_reference(checkpoint, torch.float32)


def _gdn_ours(module: Any, x: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, conv_state, state = gdn.gated_delta_net(
        F.linear(x, module.in_proj_qkv.weight),
        F.linear(x, module.in_proj_z.weight),
        F.linear(x, module.in_proj_a.weight),
        F.linear(x, module.in_proj_b.weight),
        module.conv1d.weight.squeeze(1),
        module.A_log,
        module.dt_bias,
        module.norm.weight,
        num_k_heads=module.num_k_heads,
        head_k_dim=module.head_k_dim,
        head_v_dim=module.head_v_dim,
        eps=module.layer_norm_epsilon,
        gate_activation=module.norm.activation,
        **kwargs,
    )
    return F.linear(y, module.out_proj.weight), conv_state, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gdn_layer_matches_transformers(hf32: Any, checkpoint: Path, dtype: torch.dtype) -> None:
    hf = hf32 if dtype == torch.float32 else load_reference(checkpoint, dtype)
    module = hf.model.layers[0].linear_attn
    # 150 tokens: more than two 64-token chunks of the reference's chunked form.
    x = torch.randn(2, 150, hf.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        expected = module(x)
        ours, _, _ = _gdn_ours(module, x)
    assert rel_err(ours, expected) < (FP32_TOL if dtype == torch.float32 else HALF_TOL[dtype])


def test_gdn_streaming_equals_full_sequence(hf32: Any) -> None:
    module = hf32.model.layers[1].linear_attn
    x = torch.randn(2, 90, hf32.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _, _ = _gdn_ours(module, x)
        pieces, conv_state, state = [], None, None
        # chunked prefill (a chunk shorter than the conv kernel included), then single-step decode
        for start, end in [(0, 2), (2, 40), (40, 83)] + [(t, t + 1) for t in range(83, 90)]:
            decode = end - start == 1
            y, conv_state, state = _gdn_ours(
                module,
                x[:, start:end],
                conv_state=conv_state,
                recurrent_state=state,
                chunk_size=None if decode else 16,
            )
            pieces.append(y)
    assert rel_err(torch.cat(pieces, dim=1), full) < FP32_TOL


def test_delta_rule_chunked_equals_recurrent() -> None:
    gen = torch.Generator().manual_seed(3)
    b, t, h, dk, dv = 2, 45, 3, 16, 8
    q, k = torch.randn(b, t, h, dk, generator=gen), torch.randn(b, t, h, dk, generator=gen)
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen) * 2
    beta = torch.rand(b, t, h, generator=gen)
    s0 = torch.randn(b, h, dk, dv, generator=gen)
    o_rec, s_rec = gdn.gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    for chunk in (1, 7, 64):
        o_chunk, s_chunk = gdn.gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=chunk)
        assert rel_err(o_chunk, o_rec) < 1e-5
        assert rel_err(s_chunk, s_rec) < 1e-5


def test_dilated_conv_streaming_equals_full() -> None:
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(1, 30, 5, generator=gen), torch.randn(5, 4, generator=gen)
    full, _ = causal_conv1d(x, w, None, dilation=3)
    expected = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (9, 0)), w.unsqueeze(1), groups=5, dilation=3))
    assert rel_err(full, expected.transpose(1, 2)) < 1e-6
    y1, state = causal_conv1d(x[:, :4], w, None, dilation=3)
    y2, state = causal_conv1d(x[:, 4:5], w, state, dilation=3)
    y3, _ = causal_conv1d(x[:, 5:], w, state, dilation=3)
    assert rel_err(torch.cat([y1, y2, y3], dim=1), full) < 1e-6


def _causal_mask(batch: int, length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril().expand(batch, 1, length, length)


def _qsa_kwargs(hf: Any, module: Any) -> dict[str, Any]:
    cfg = hf.config
    return {
        "q_norm_weight": module.q_norm.weight,
        "k_norm_weight": module.k_norm.weight,
        "index_q_norm_weight": module.indexer.q_layernorm.weight,
        "index_k_norm_weight": module.indexer.k_layernorm.weight,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rotary_dim": int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]),
        "rope_theta": cfg.rope_parameters["rope_theta"],
        "eps": cfg.rms_norm_eps,
        "num_index_heads": cfg.indexer_n_heads,
        "index_head_dim": cfg.indexer_head_dim,
        "budget": cfg.indexer_budget,
        "ratio": cfg.indexer_compress_ratio,
    }


# `qsa_attention` arguments that only the ring form's second half (`attend_ring`) takes.
RING_ONLY = ("index_k_norm_weight", "ratio")


def _qsa_ours(hf: Any, module: Any, x: torch.Tensor, positions: torch.Tensor, **past: Any) -> tuple[Any, ...]:
    out, k, v, keys = qsa.qsa_attention(
        F.linear(x, module.q_proj.weight),
        F.linear(x, module.k_proj.weight),
        F.linear(x, module.v_proj.weight),
        F.linear(x, module.indexer.index_qk_proj.weight),
        positions,
        **_qsa_kwargs(hf, module),
        **past,
    )
    return F.linear(out, module.o_proj.weight), k, v, keys


def _qsa_reference(hf: Any, module: Any, x: torch.Tensor) -> torch.Tensor:
    length = x.shape[1]
    positions = torch.arange(length).view(1, 1, -1).expand(3, x.shape[0], -1)
    cos_sin = hf.model.rotary_emb(x, positions)
    out, _ = module(x, cos_sin, attention_mask=_causal_mask(x.shape[0], length))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qsa_attention_matches_transformers(hf32: Any, checkpoint: Path, dtype: torch.dtype) -> None:
    hf = hf32 if dtype == torch.float32 else load_reference(checkpoint, dtype)
    module = hf.model.layers[3].self_attn
    # 70 tokens: 17 complete blocks of 4 for the last queries, far beyond the 4-block budget.
    x = torch.randn(1, 70, hf.config.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.no_grad():
        expected = _qsa_reference(hf, module, x)
        ours, *_ = _qsa_ours(hf, module, x[0], torch.arange(70))
        tol = FP32_TOL if dtype == torch.float32 else HALF_TOL[dtype]
        assert rel_err(ours, expected[0]) < tol
        if dtype == torch.float32:
            # The selection matters: with an unbounded budget (dense causal attention) the
            # result is clearly different, so this test would notice a wrong selection.
            budget = hf.config.indexer_budget
            hf.config.indexer_budget = 10_000
            try:
                dense, *_ = _qsa_ours(hf, module, x[0], torch.arange(70))
            finally:
                hf.config.indexer_budget = budget
            assert rel_err(dense, expected[0]) > 1e-2


def test_qsa_streaming_equals_full_sequence(hf32: Any) -> None:
    module = hf32.model.layers[3].self_attn
    x = torch.randn(61, hf32.config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full, *_ = _qsa_ours(hf32, module, x, torch.arange(61))
        pieces: list[torch.Tensor] = []
        past: dict[str, Any] = {}
        for start, end in [(0, 9), (9, 10), (10, 47)] + [(t, t + 1) for t in range(47, 61)]:
            out, k, v, keys = _qsa_ours(hf32, module, x[start:end], torch.arange(start, end), **past)
            past = {"past_k": k, "past_v": v, "past_index_keys": keys}
            pieces.append(out)
    assert rel_err(torch.cat(pieces), full) < FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qsa_ring_form_equals_reference_form(hf32: Any, checkpoint: Path, dtype: torch.dtype) -> None:
    # The serving form keeps one key per complete group (computed once, when the group closes)
    # and the open group's raw keys; the reference recomputes every block key from every raw key
    # at each step. Chunks end inside groups and span several groups: the outputs are identical.
    hf = hf32 if dtype == torch.float32 else load_reference(checkpoint, dtype)
    module, cfg = hf.model.layers[3].self_attn, hf.config
    ratio = cfg.indexer_compress_ratio
    x = torch.randn(61, cfg.hidden_size, generator=torch.Generator().manual_seed(7)).to(dtype)
    names = ("q_proj", "k_proj", "v_proj")
    with torch.no_grad():
        ref_past: dict[str, Any] = {}
        k_all = v_all = None
        indexer: qsa.IndexerPast | None = None
        for start, end in [(0, 9), (9, 10), (10, 13), (13, 47)] + [(t, t + 1) for t in range(47, 61)]:
            xs, positions = x[start:end], torch.arange(start, end)
            expected, k, v, keys = _qsa_ours(hf, module, xs, positions, **ref_past)
            ref_past = {"past_k": k, "past_v": v, "past_index_keys": keys}
            kwargs = _qsa_kwargs(hf, module)
            prepared = qsa.prepare_tokens(
                *[F.linear(xs, getattr(module, n).weight) for n in names],
                F.linear(xs, module.indexer.index_qk_proj.weight),
                positions,
                **{k: v for k, v in kwargs.items() if k not in RING_ONLY},
            )
            out, k_new, v_new, step = qsa.attend_ring(
                prepared,
                positions,
                **{k: kwargs[k] for k in (*RING_ONLY, "rotary_dim", "rope_theta", "eps", "budget")},
                past_k=k_all,
                past_v=v_all,
                past_indexer=indexer,
            )
            assert torch.equal(F.linear(out, module.o_proj.weight), expected)
            assert step is not None and step.block_keys.shape[0] == end // ratio - start // ratio
            assert step.open_keys.shape[0] == end % ratio
            k_all = k_new if k_all is None else torch.cat([k_all, k_new])
            v_all = v_new if v_all is None else torch.cat([v_all, v_new])
            old_keys = [] if indexer is None else [indexer.block_keys]
            indexer = qsa.IndexerPast(torch.cat([*old_keys, step.block_keys]), step.open_keys)
        # a cache whose open group does not match the position is refused, not misread
        with pytest.raises(ValueError, match="QSA open group: 0 raw keys cached for position 61"):
            qsa.close_groups(
                qsa.IndexerPast(indexer.block_keys, indexer.open_keys[:0]), x[:1, :32], 61, ratio,
                module.indexer.k_layernorm.weight, cfg.rms_norm_eps, 1e4, 16,
            )  # fmt: skip


def _hc_ours(module: Any, streams: torch.Tensor, hc_count: int, eps: float) -> tuple[Any, ...]:
    inject = module.block_inject_weight.weight if module.block_inject_weight is not None else None
    return hyper_connection.hc_mix(
        streams,
        module.hc_norm.weight,
        module.input_mix_weight_down.weight,
        module.input_mix_weight_up.weight,
        inject,
        hc_count=hc_count,
        eps=eps,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hyper_connection_matches_transformers(hf32: Any, checkpoint: Path, dtype: torch.dtype) -> None:
    hf = hf32 if dtype == torch.float32 else load_reference(checkpoint, dtype)
    cfg = hf.config
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL[dtype]
    streams = torch.randn(2, 9, cfg.hc_count * cfg.hidden_size, generator=torch.Generator().manual_seed(7)).to(dtype)
    block_out = torch.randn(2, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(8)).to(dtype)
    with torch.no_grad():
        module = hf.model.layers[2].mlp_hyper_connection
        mixed_ref, hyper_input, inject_ref = module(streams)
        mixed, inject = _hc_ours(module, streams, cfg.hc_count, cfg.rms_norm_eps)
        assert inject is not None
        assert rel_err(mixed, mixed_ref) < tol
        assert rel_err(inject, inject_ref) < tol
        after_ref = hyper_input + (block_out.unsqueeze(-2) * inject_ref.unsqueeze(-1)).flatten(-2)
        assert rel_err(hyper_connection.hc_inject(streams, block_out, inject), after_ref) < tol
        final_ref = hf.model.hyper_connection_mixer(streams)
        final, none = _hc_ours(hf.model.hyper_connection_mixer, streams, cfg.hc_count, cfg.rms_norm_eps)
        assert none is None
        assert rel_err(final, final_ref) < tol


def _ple_ours(hf: Any, layer: int, streams: torch.Tensor, ids: torch.Tensor, **state: Any) -> tuple[Any, ...]:
    module = hf.model.layers[layer].ple
    emb = module.ple_embedding
    return ple.ple(
        streams,
        ids,
        emb.ngram_embedding.weight,
        emb.layer_multipliers,
        emb.ngram_heads_vocab_sizes,
        emb.ngram_heads_offsets,
        module.key_proj.weight,
        module.value_proj.weight,
        module.norm_key.weight,
        module.norm_query.weight,
        module.norm_conv.weight,
        module.conv1d.weight.squeeze(1),
        hc_count=hf.config.hc_count,
        heads_per_ngram=hf.config.heads_per_ngram,
        eos_token_id=EOS,
        eps=hf.config.rms_norm_eps,
        **state,
    )


def _ple_token_ids(length: int, seed: int) -> torch.Tensor:
    ids = torch.randint(0, 248_000, (2, length), generator=torch.Generator().manual_seed(seed))
    ids[0, 5] = EOS  # n-grams must not reach back across an EOS
    ids[1, 20:22] = EOS
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ple_matches_transformers(hf32: Any, checkpoint: Path, dtype: torch.dtype) -> None:
    hf = hf32 if dtype == torch.float32 else load_reference(checkpoint, dtype)
    cfg = hf.config
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL[dtype]
    ids = _ple_token_ids(40, 9)
    streams = torch.randn(2, 40, cfg.hc_count * cfg.hidden_size, generator=torch.Generator().manual_seed(10))
    streams = streams.to(dtype)
    with torch.no_grad():
        for layer in (0, 1):  # two PLE layers: different hash heads and tables
            expected = hf.model.layers[layer].ple(streams, ids, None)
            ours, _, _ = _ple_ours(hf, layer, streams, ids)
            assert rel_err(ours, expected) < tol


def test_ple_ngram_rows_match_transformers(hf32: Any) -> None:
    ids = _ple_token_ids(40, 11)
    emb = hf32.model.layers[1].ple.ple_embedding
    with torch.no_grad():
        expected_rows = []
        # The reference exposes rows only through its embedding; invert it with an identity table.
        weight = emb.ngram_embedding.weight
        table = torch.arange(weight.shape[0], dtype=torch.float32).unsqueeze(1).expand_as(weight).contiguous()
        emb.ngram_embedding.weight = torch.nn.Parameter(table)
        try:
            expected_rows = emb(ids, None).unflatten(-1, (-1, weight.shape[1]))[..., 0].long()
        finally:
            emb.ngram_embedding.weight = weight
    rows, context = ple.ngram_ids(
        ids,
        ple.initial_context(2, 3, EOS),
        emb.layer_multipliers,
        emb.ngram_heads_vocab_sizes,
        emb.ngram_heads_offsets,
        heads_per_ngram=hf32.config.heads_per_ngram,
        eos_token_id=EOS,
    )
    assert torch.equal(rows, expected_rows)
    assert torch.equal(context, ids[:, -2:])


def test_ple_streaming_equals_full_sequence(hf32: Any) -> None:
    cfg = hf32.config
    ids = _ple_token_ids(40, 12)
    streams = torch.randn(2, 40, cfg.hc_count * cfg.hidden_size, generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        full, _, _ = _ple_ours(hf32, 0, streams, ids)
        pieces, state = [], {}
        for start, end in [(0, 1), (1, 4), (4, 25)] + [(t, t + 1) for t in range(25, 40)]:
            out, context, conv_state = _ple_ours(hf32, 0, streams[:, start:end], ids[:, start:end], **state)
            state = {"context": context, "conv_state": conv_state}
            pieces.append(out)
    assert rel_err(torch.cat(pieces, dim=1), full) < FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_moe_matches_transformers(hf32: Any, checkpoint: Path, dtype: torch.dtype) -> None:
    hf = hf32 if dtype == torch.float32 else load_reference(checkpoint, dtype)
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL[dtype]
    block = hf.model.layers[2].mlp
    x = torch.randn(3, 11, hf.config.hidden_size, generator=torch.Generator().manual_seed(14)).to(dtype)
    with torch.no_grad():
        expected = block(x)
        shared = block.shared_expert
        ours = moe.moe(
            x.flatten(0, 1),
            block.gate.weight,
            block.experts.gate_up_proj,
            block.experts.down_proj,
            torch.cat([shared.gate_proj.weight, shared.up_proj.weight]),
            shared.down_proj.weight,
            block.shared_expert_gate.weight,
            top_k=hf.config.num_experts_per_tok,
            normalize=hf.config.norm_topk_prob,
        )
    assert rel_err(ours, expected.flatten(0, 1)) < tol
