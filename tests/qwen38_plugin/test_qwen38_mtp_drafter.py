"""Issue 12 item 1, step 4: the portable MTP drafter (`qwen38_plugin.vllm_mtp.PortableQwen4ExpMTP`,
registered as ``Qwen4ExpMTP`` through the dispatcher) against the plain-torch oracle
(`qwen38_plugin.mtp_reference`, stock's semantics).

The drafter is built from the checkpoint as vLLM's loader builds it (its config is the target's,
its weights the ``mtp.*`` tensors; the target's embedding and lm_head shared in, as vLLM's V1
proposer does), and run as the proposer runs it: a first pass over a whole sequence (the
target's pre-mixer streams, the next tokens), then draft steps of one token reading its own
output streams, each step on vLLM-style metadata (a scattered block table, slots, step starts).
Its logits and draft tokens equal the oracle's, through K/V and indexer-key caches that cross
block boundaries with the indexer selecting among complete groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from qwen38_plugin.model import DictStateStore, SequenceCache
from tests.qwen38_plugin.test_qwen38_mtp_reference import MTP, _oracle

BLOCK = 16
LENGTH = 41  # > indexer_budget (16): the indexer selects; crosses two block boundaries
DRAFTS = 4


@pytest.fixture(scope="module")
def drafter(tiny_checkpoint: Callable[..., Path], vllm_single_rank: None) -> Iterator[tuple[Any, Any]]:
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    from qwen38_plugin import register
    from qwen38_plugin.model import iter_safetensors
    from qwen38_plugin.vllm_dispatch import Qwen4ExpMTP
    from qwen38_plugin.vllm_mtp import PortableQwen4ExpMTP

    register()
    model_dir = tiny_checkpoint("qwen4_exp_text", overrides=MTP, dtype="float32")
    args = EngineArgs(
        model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256, enable_prefix_caching=False,
        speculative_config={"method": "mtp", "num_speculative_tokens": DRAFTS},
    )  # fmt: skip
    vllm_config = args.create_engine_config()
    # the config hook widened vLLM's proposer buffer to the target's streams (hc * H)
    draft_config = vllm_config.speculative_config.draft_model_config.hf_config
    assert draft_config.hc_mult == 4 and hasattr(draft_config, "compress_ratios")
    with pytest.MonkeyPatch.context() as env, set_current_vllm_config(vllm_config):
        env.setenv("QWEN38_PLE_TABLE", "device")
        model = initialize_model(vllm_config, model_class=Qwen4ExpMTP)  # the dispatcher picks the portable head
        tensors = list(iter_safetensors(model_dir))
        loaded = model.load_weights(iter(tensors))
        assert loaded >= {name for name, _ in model.named_parameters()}
        # The drafter holds no vocabulary rows of its own: vLLM's proposer sets the target's.
        assert not any(p.shape[0] == draft_config.vocab_size for p in model.parameters())
        with pytest.raises(RuntimeError, match="MTP drafter's embed_tokens was not set from the target"):
            model.embed_input_ids(torch.tensor([1]))
        named = dict(tensors)
        config = vllm_config.model_config.hf_text_config
        embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        with torch.no_grad():  # the target's layers, as vLLM's proposer shares them
            embed.weight.copy_(named["model.embed_tokens.weight"])
            lm_head.weight.copy_(named["lm_head.weight"])
        model.model.embed_tokens, model.lm_head = embed, lm_head
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    assert isinstance(model, PortableQwen4ExpMTP)
    yield model, vllm_config


def _meta(counts: list[int], starts: list[int], tables: torch.Tensor) -> Any:
    """The metadata of one step: request r runs ``counts[r]`` tokens from position ``starts[r]``."""
    from qwen38_plugin.vllm_qsa_cache import QSAMetadata

    req = torch.cat([torch.full((n,), r) for r, n in enumerate(counts)])
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
    slots = tables[req, positions // BLOCK].long() * BLOCK + positions % BLOCK
    return QSAMetadata(
        int(req.shape[0]), req.int(), torch.tensor(starts, dtype=torch.int32), tables, slots, positions
    )  # fmt: skip


def test_drafter_logits_and_tokens_equal_the_oracle(
    drafter: tuple[Any, Any], tiny_checkpoint: Callable[..., Path]
) -> None:
    """Two requests (41 and 23 tokens) in every step, as the proposer batches them."""
    from vllm.forward_context import set_forward_context

    model, vllm_config = drafter
    core, head = _oracle(tiny_checkpoint)
    torch.manual_seed(0)
    lengths = [LENGTH, 23]
    sequences, target_streams, expected = [], [], []
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, 248_000, (n,))
            _, streams = core.forward_streams(ids, torch.arange(n), [n], DictStateStore(core, [SequenceCache()]))
            sequences.append(ids)
            target_streams.append(streams[:-1])
            expected.append(head.draft(core, streams[:-1], ids, k=DRAFTS))

    cache = model.model.layers[0].self_attn.cache
    config = model.config
    blocks = 12
    # poisoned: every row a step reads must have been written by the drafter
    cache.bind_kv_cache(torch.full((blocks, cache.num_kv_heads, BLOCK, 2 * config.head_dim), float("nan")))
    assert cache.raw_keys.shape == (blocks, 1, BLOCK, config.indexer_head_dim)
    assert cache.group_key_cache.shape == (blocks, 1, BLOCK // config.indexer_compress_ratio, config.indexer_head_dim)
    tables = torch.tensor([[7, 2, 9, 0, 11], [4, 1, 10, 3, 5]], dtype=torch.int32)  # scattered blocks

    def step(hidden: torch.Tensor, tokens: torch.Tensor, counts: list[int], starts: list[int]) -> torch.Tensor:
        meta = _meta(counts, starts, tables)
        with set_forward_context({cache.prefix: meta}, vllm_config), torch.no_grad():
            return model(tokens, meta.positions, hidden)

    # the proposer's first pass: position p with token p + 1, both requests in one step
    counts = [n - 1 for n in lengths]
    first = step(torch.cat(target_streams), torch.cat([ids[1:] for ids in sequences]), counts, [0, 0])
    first_logits = model.compute_logits(first)
    assert bool(torch.isfinite(first).all())
    torch.testing.assert_close(first_logits, torch.cat([e[2] for e in expected]), rtol=1e-4, atol=1e-4)
    last = torch.tensor(counts).cumsum(0) - 1
    hidden, logits = first[last], first_logits[last]
    drafts, draft_logits = [], [logits]
    for j in range(1, DRAFTS + 1):
        token = logits.argmax(-1)
        drafts.append(token.tolist())
        if j == DRAFTS:
            break
        # the proposer's draft step: one token per request, reading its own streams
        hidden = step(hidden, token, [1, 1], [n - 2 + j for n in lengths])
        logits = model.compute_logits(hidden)
        draft_logits.append(logits)
    for r, (expected_drafts, expected_logits, _) in enumerate(expected):
        torch.testing.assert_close(torch.stack([lg[r] for lg in draft_logits]), expected_logits, rtol=1e-4, atol=1e-4)
        assert [d[r] for d in drafts] == expected_drafts


def test_v1_proposer_buffer_holds_the_target_streams(drafter: tuple[Any, Any]) -> None:
    """vLLM's V1 proposer (the CPU runner's) sizes its hidden-state buffer from the draft config:
    the config hook (`qwen38_plugin.vllm_config_hook`) makes it ``hc * H`` wide, the width of
    `get_mtp_target_hidden_states`. Fails here, not mid-request, if a vLLM changes that rule."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.spec_decode.eagle import EagleProposer

    model, vllm_config = drafter
    with set_current_vllm_config(vllm_config):
        proposer = EagleProposer(vllm_config, torch.device("cpu"))
    width = model.config.hc_count * model.config.hidden_size
    assert proposer.hidden_states.shape == (vllm_config.scheduler_config.max_num_batched_tokens, width)


def test_drafter_refuses_a_checkpoint_without_mtp_head(
    tiny_checkpoint: Callable[..., Path], vllm_single_rank: None
) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    from qwen38_plugin.model import ConfigError
    from qwen38_plugin.vllm_mtp import PortableQwen4ExpMTP

    model_dir = tiny_checkpoint("qwen4_exp_text", dtype="float32")
    vllm_config = EngineArgs(
        model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256
    ).create_engine_config()
    with (
        set_current_vllm_config(vllm_config),
        pytest.raises(ConfigError, match="mtp_num_hidden_layers: 0; the checkpoint has no MTP head"),
    ):
        PortableQwen4ExpMTP(vllm_config=vllm_config)


def test_draft_caches_follow_the_model_runner(drafter: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU (V1): side tensors (the engine tests' path). CUDA: vLLM's V2 runner gets the target's three
    caches, inside vLLM's KV-cache accounting; V1 is refused (its side tensors ran the H200 out of memory)."""
    from qwen38_plugin.model import ConfigError
    from qwen38_plugin.vllm_mtp import DraftQSAKVCache, draft_cache_class
    from qwen38_plugin.vllm_qsa_cache import QSAKVCache

    _, vllm_config = drafter
    assert isinstance(drafter[0].model.layers[0].self_attn.cache, DraftQSAKVCache)  # built on this CPU
    assert draft_cache_class(vllm_config, on_cuda=False) is DraftQSAKVCache
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert draft_cache_class(vllm_config, on_cuda=True) is QSAKVCache
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(
        ConfigError, match=r"needs vLLM's V2 model runner .*unset VLLM_USE_V2_MODEL_RUNNER or set it to 1"
    ):
        draft_cache_class(vllm_config, on_cuda=True)
