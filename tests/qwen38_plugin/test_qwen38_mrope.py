"""M-RoPE in the portable text model (issue 13 item 1, groundwork of the portable
`Qwen4ExpForConditionalGeneration`), against transformers' Qwen4Exp.

vLLM hands a model whose config carries ``rope_parameters.mrope_section`` positions ``[3, T]``
(T, H, W rows; image and video tokens have different H and W, text tokens three equal values).
transformers' `Qwen4ExpTextRotaryEmbedding` lays the three rows out interleaved over the
frequencies; the QSA layer rotates q, k, the indexer's queries and each group's compressed key
(at the group's first token, which an earlier step may have seen: its positions come from the
key ring).

- `RotaryTable.cos_sin` equals transformers' rotary bit for bit, fp32 and bf16, text-only and
  image / video positions, the tiny and the Flash-Next geometry, with and without an explicit
  ``mrope_section``;
- one QSA layer of the served model (vLLM's layers, the paged caches, steps of a chunked prefill
  whose groups straddle steps) with image-style positions equals transformers'
  `Qwen4ExpTextAttention` on the whole sequence (fp32), and text-only ``[3, T]`` positions give the
  ``[T]`` results bit for bit;
- the model's forward with ``[3, T]`` positions and the multimodal model's ``inputs_embeds``
  still traces as one graph, dynamic token count; the embeddings replace the token embeddings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# The tiny checkpoint's rotary dim is 16 (8 frequencies): a section that covers them (T 4, H 2, W 2).
TINY_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [4, 2, 2],
    "mrope_interleaved": True,
}


def _vision_positions(start: int, grid: tuple[int, int, int]) -> torch.Tensor:
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpModel

    # transformers' own layout of an image's (or a video frame's) merged tokens (spatial merge 2)
    return Qwen4ExpModel.get_vision_position_ids(None, start, torch.tensor(grid), 1, 2)  # type: ignore[arg-type]


def image_style_positions() -> torch.Tensor:
    """``[3, 46]``: text, an image, text, a wide image, text, laid out as transformers'
    `get_rope_index` lays them out (a vision item advances the text position by max(h, w))."""
    parts, pos = [], 0
    for kind, value in (("text", 5), ("image", (1, 8, 6)), ("text", 6), ("image", (1, 6, 10)), ("text", 8)):
        if kind == "text":
            assert isinstance(value, int)
            parts.append(torch.arange(pos, pos + value).expand(3, -1))
            pos += value
        else:
            assert isinstance(value, tuple)
            parts.append(_vision_positions(pos, value))
            pos += max(value[1], value[2]) // 2
    return torch.cat(parts, dim=1)


def video_style_positions() -> torch.Tensor:
    """``[3, T]``: a 3-frame video (each frame its own grid, as transformers splits videos) between text."""
    parts = [torch.arange(0, 3).expand(3, -1)]
    pos = 3
    for _ in range(3):
        parts.append(_vision_positions(pos, (1, 4, 8)))
        pos += 4
    parts.append(torch.arange(pos, pos + 4).expand(3, -1))
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("head_dim", "rope"),
    [
        (64, TINY_ROPE),
        (256, {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
               "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
        (256, {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}),
        (64, {"rope_type": "default", "rope_theta": 1_000_000.0}),  # section clipped at 32 frequencies
    ],
    ids=["tiny", "flash-next", "flash-next-default-section", "full-rotary"],
)  # fmt: skip
def test_rotary_table_equals_transformers(head_dim: int, rope: dict[str, Any], dtype: torch.dtype) -> None:
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRotaryEmbedding

    from qwen38_plugin.vllm_qsa import RotaryTable

    config = Qwen4ExpTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rope_parameters=dict(rope)
    )
    theirs = Qwen4ExpTextRotaryEmbedding(config)
    ours = RotaryTable.from_config(config, 512, dtype)
    x = torch.zeros(1, dtype=dtype)
    for positions in (image_style_positions(), video_style_positions(), torch.arange(300, 340).expand(3, -1)):
        cos, sin = theirs(x, positions[:, None, :])  # [1, T, rotary_dim]
        our_cos, our_sin = ours.cos_sin(positions)
        assert our_cos.dtype == dtype
        assert torch.equal(our_cos, cos[0]) and torch.equal(our_sin, sin[0])
    # three equal rows: the [T] table's values, bit for bit
    text = torch.arange(0, 512, 7)
    for got, want in zip(ours.cos_sin(text.expand(3, -1)), ours.cos_sin(text), strict=True):
        assert torch.equal(got, want)
    # the sections do rotate H and W differently from T (else the test above proves little)
    image = image_style_positions()
    assert not torch.equal(ours.cos_sin(image)[0], ours.cos_sin(image[0])[0])


@pytest.fixture(scope="module")
def mrope_model(tiny_checkpoint: Callable[..., Path], vllm_single_rank: None) -> Iterator[tuple[Any, Any, Path]]:
    """(the served model, its VllmConfig, the checkpoint) for a tiny fp32 checkpoint with ``mrope_section``.

    Stock's config hook for `Qwen4ExpForCausalLM` strips ``mrope_section`` (text-only Qwen4Exp
    runs on ``[T]`` positions); the multimodal model keeps it, and builds this text model with it.
    So the section is put back as the multimodal model's text config carries it."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from qwen38_plugin import register
    from qwen38_plugin.model import iter_safetensors
    from qwen38_plugin.vllm_model import PortableQwen4ExpForCausalLM

    register()
    model_dir = tiny_checkpoint("qwen4_exp_text", dtype="float32", overrides={"rope_parameters": TINY_ROPE})
    config = EngineArgs(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256)
    vllm_config = config.create_engine_config()
    assert not vllm_config.model_config.uses_mrope  # stripped for the text-only architecture
    vllm_config.model_config.hf_text_config.rope_parameters.update(
        mrope_section=TINY_ROPE["mrope_section"], mrope_interleaved=True
    )
    assert vllm_config.model_config.uses_mrope  # vLLM would hand this model [3, T] positions
    with pytest.MonkeyPatch.context() as env, set_current_vllm_config(vllm_config):
        env.setenv("QWEN38_PLE_TABLE", "device")
        model = initialize_model(vllm_config, model_class=PortableQwen4ExpForCausalLM)
        model.load_weights(iter_safetensors(model_dir))
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    yield model, vllm_config, model_dir


def _run_layer_in_steps(
    model: Any, vllm_config: Any, hidden: torch.Tensor, positions: torch.Tensor, chunks: list[int]
) -> torch.Tensor:
    """The first QSA layer's forward over one request's tokens, a chunked prefill of ``chunks``
    tokens per step, on fresh paged caches (K/V and block keys in blocks 1.., the ring in block 1)."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from qwen38_plugin.vllm_qsa import PortableQSAAttention
    from qwen38_plugin.vllm_qsa_cache import QSAMetadataBuilder

    attn = next(m for m in model.modules() if isinstance(m, PortableQSAAttention))
    cache = attn.cache
    assert cache.block_keys is not None and cache.ring is not None
    tokens = hidden.shape[0]
    assert sum(chunks) == tokens
    block_size, ratio = vllm_config.cache_config.block_size, cache.ratio
    blocks = -(-tokens // block_size)
    table = torch.arange(1, 1 + blocks, dtype=torch.int32).view(1, blocks)
    di = cache.block_keys.index_dim
    layers = {
        cache.prefix: (cache, torch.zeros(1 + blocks, attn.num_kv_heads, block_size, 2 * attn.head_dim)),
        cache.block_keys.prefix: (cache.block_keys, torch.zeros(1 + blocks, 1, block_size // ratio, di)),
        # uninitialised rows hold garbage in a real cache: so here
        cache.ring.prefix: (cache.ring, torch.full((2, 1, cache.ring.capacity, cache.ring.row_size), 7.5e3)),
    }
    ring_table = torch.tensor([[1]], dtype=torch.int32)
    tables = {cache.prefix: table, cache.block_keys.prefix: table, cache.ring.prefix: ring_table}
    for layer, tensor in layers.values():
        layer.bind_kv_cache(tensor)
    outs, done = [], 0
    for n in chunks:
        seq = torch.arange(done, done + n)
        qsl = torch.tensor([0, n], dtype=torch.int32)
        metadata = {}
        for name, (layer, _) in layers.items():
            builder = QSAMetadataBuilder(layer.get_kv_cache_spec(vllm_config), [name], vllm_config, torch.device("cpu"))
            common = CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor([done + n], dtype=torch.int32),
                num_reqs=1, num_actual_tokens=n, max_query_len=n, max_seq_len=done + n,
                block_table_tensor=tables[name],
                slot_mapping=(table[0, seq // block_size] * block_size + seq % block_size).long(),
            )  # fmt: skip
            metadata[name] = builder.build(0, common)
        with set_forward_context(metadata, vllm_config), torch.no_grad():
            outs.append(attn.forward(positions[..., done : done + n], hidden[done : done + n]))
        done += n
    return torch.cat(outs)


def _transformers_layer(model_dir: Path, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' `Qwen4ExpTextAttention` (the checkpoint's first QSA layer) over the whole
    sequence, rotated by the text model's own `rotary_emb` at ``positions [3, T]``."""
    from transformers import Qwen4ExpForCausalLM

    reference = Qwen4ExpForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    text = reference.model
    index = text.config.layer_types.index("indexed_attention")
    layer = text.layers[index].self_attn
    tokens = hidden.shape[0]
    x = hidden[None]
    position_embeddings = text.rotary_emb(x, positions[:, None, :])
    causal = torch.full((tokens, tokens), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        out, _ = layer(x, position_embeddings, causal)
    return out[0]


CHUNKS = [6, 3, 5, 1, 1, 1, 2, 27]  # groups of 4 straddle steps: their first tokens come from the ring


def test_qsa_layer_with_image_positions_equals_transformers(mrope_model: tuple[Any, Any, Path]) -> None:
    model, vllm_config, model_dir = mrope_model
    positions = image_style_positions()
    tokens = positions.shape[1]
    hidden = torch.randn(tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    theirs = _transformers_layer(model_dir, positions, hidden)
    ours = _run_layer_in_steps(model, vllm_config, hidden, positions, CHUNKS)
    error = float((ours - theirs).norm() / theirs.norm())
    assert error <= 1e-5, error
    # the positions matter: rotating at the sequence index instead is far off
    plain = _run_layer_in_steps(model, vllm_config, hidden, torch.arange(tokens), CHUNKS)
    assert float((plain - theirs).norm() / theirs.norm()) > 1e-3
    # and in one step (no group start from the ring) the same as in steps
    whole = _run_layer_in_steps(model, vllm_config, hidden, positions, [tokens])
    assert float((whole - theirs).norm() / theirs.norm()) <= 1e-5


def test_text_only_mrope_positions_give_the_plain_results_bit_for_bit(mrope_model: tuple[Any, Any, Path]) -> None:
    model, vllm_config, _ = mrope_model
    tokens = sum(CHUNKS)
    hidden = torch.randn(tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    plain = _run_layer_in_steps(model, vllm_config, hidden, torch.arange(tokens), CHUNKS)
    mrope = _run_layer_in_steps(model, vllm_config, hidden, torch.arange(tokens).expand(3, -1), CHUNKS)
    assert torch.equal(plain, mrope)


def test_key_ring_rows_hold_the_rope_positions(mrope_model: tuple[Any, Any, Path]) -> None:
    """With M-RoPE the ring row is the raw key (32 fp32) then three int64 (6 fp32 columns)."""
    from qwen38_plugin.vllm_qsa import PortableQSAAttention

    model, vllm_config, _ = mrope_model
    ring = next(m for m in model.modules() if isinstance(m, PortableQSAAttention)).cache.ring
    assert ring is not None
    assert ring.get_kv_cache_spec(vllm_config).head_size == 32 + 6
    ring.bind_kv_cache(torch.zeros(2, 1, ring.capacity, 38))
    assert ring.keys.shape == (2, 1, ring.capacity, 32)
    positions = ring.rope_positions
    assert positions is not None and positions.dtype == torch.int64 and positions.shape == (2, 1, ring.capacity, 3)
    positions[1, 0, 2] = torch.tensor([7, 1 << 40, 9])  # int64 values no float column could hold
    assert ring.rope_positions is not None and ring.rope_positions[1, 0, 2].tolist() == [7, 1 << 40, 9]
    assert not ring.keys.any()


def test_forward_with_mrope_positions_and_embeddings_traces_as_one_graph(mrope_model: tuple[Any, Any, Path]) -> None:
    """The multimodal model hands the text model [3, T] positions and its own embeddings (image
    features over the placeholder rows) besides the token ids (PLE hashes them): one graph,
    dynamic token count, equal to eager."""
    from vllm.forward_context import set_forward_context

    model, vllm_config, _ = mrope_model
    torch._dynamo.reset()
    compiled = torch.compile(model.model.forward, fullgraph=True, backend="eager", dynamic=True)
    with set_forward_context(None, vllm_config), torch.no_grad():
        for n in (5, 9):
            ids = torch.randint(0, 248_000, (n,))
            positions = torch.stack([torch.arange(n), torch.arange(n) // 2, torch.arange(n) % 3])
            embeds = torch.randn(n, model.config.hidden_size)
            for inputs_embeds in (None, embeds):
                out = compiled(ids, positions, inputs_embeds)
                assert out.shape == (n, model.config.hidden_size) and bool(torch.isfinite(out).all())
                assert torch.equal(out, model.model.forward(ids, positions, inputs_embeds))


def test_inputs_embeds_replace_the_token_embeddings(mrope_model: tuple[Any, Any, Path]) -> None:
    """Without a step's metadata the stateful ops write zeros, so each row depends on its own
    embedding only: the token embeddings passed in give the plain forward bit for bit, and rows
    given other embeddings (as image features) change, the others do not."""
    from vllm.forward_context import set_forward_context

    model, vllm_config, _ = mrope_model
    n = 12
    ids = torch.randint(0, 248_000, (n,), generator=torch.Generator().manual_seed(8))
    positions = torch.arange(n).expand(3, -1)
    with set_forward_context(None, vllm_config), torch.no_grad():
        plain = model(ids, positions)
        embeds = model.embed_input_ids(ids)
        assert torch.equal(model(ids, positions, inputs_embeds=embeds), plain)
        image_rows = torch.arange(3, 8)
        embeds[image_rows] = torch.randn(len(image_rows), model.config.hidden_size)
        mixed = model(ids, positions, inputs_embeds=embeds)
    others = torch.ones(n, dtype=torch.bool)
    others[image_rows] = False
    assert torch.equal(mixed[others], plain[others])
    assert not torch.isclose(mixed[image_rows], plain[image_rows]).all(dim=-1).any()
