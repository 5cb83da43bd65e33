"""Issue 12 item 1, step 4 (partial): the MTP head's oracle and the target's side of MTP.

- The tiny checkpoint builder writes random ``mtp.*`` tensors when ``mtp_num_hidden_layers`` is set,
  named as stock vLLM's `Qwen4ExpMTP` loads them; the plain-torch oracle
  (`qwen38_plugin.mtp_reference`) loads exactly those (no missing, no unexpected tensor).
- The oracle run token by token equals the same head run on the whole sequence at once (its
  K/V and indexer-key cache), and its draft chain starts from the teacher-forced logits.
- The portable served model keeps the residual streams before its final mixer for vLLM's V1 MTP
  proposer (`get_mtp_target_hidden_states`): they are the streams after the last layer, computed
  here layer by layer, and the final mixer of them is the model's hidden state.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qwen38_plugin.model import Qwen4ExpCore, iter_safetensors
from qwen38_plugin.mtp_reference import MTPCache, Qwen4ExpMTPReference
from qwen38_plugin.ops import hyper_connection
from tests.qwen38_plugin.test_qwen38_vllm_model import served  # noqa: F401  (the built model, a fixture)

MTP = {"mtp_num_hidden_layers": 1}


def _oracle(tiny_checkpoint: Callable[..., Path]) -> tuple[Qwen4ExpCore, Qwen4ExpMTPReference]:
    return load_oracle(tiny_checkpoint("qwen4_exp_text", overrides=MTP, dtype="float32"))


def load_oracle(model_dir: Path) -> tuple[Qwen4ExpCore, Qwen4ExpMTPReference]:
    """The plain-torch target and MTP head of the checkpoint ``model_dir`` (eval)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    core, head = Qwen4ExpCore(config), Qwen4ExpMTPReference(config)
    tensors = list(iter_safetensors(model_dir))
    core.load_checkpoint_tensors(tensors)  # skips mtp.*
    loaded = head.load_checkpoint_tensors(tensors)  # raises on a missing or unexpected mtp.* tensor
    assert loaded == set(dict(head.named_parameters()))
    return core.eval(), head.eval()


def test_oracle_token_by_token_equals_one_pass_and_drafts_from_it(tiny_checkpoint: Callable[..., Path]) -> None:
    from qwen38_plugin.model import DictStateStore, SequenceCache

    core, head = _oracle(tiny_checkpoint)
    torch.manual_seed(0)
    length = 41  # > indexer_budget: the indexer selects among the complete groups
    ids = torch.randint(0, 248_000, (length,))
    with torch.no_grad():
        _, streams = core.forward_streams(ids, torch.arange(length), [length], DictStateStore(core, [SequenceCache()]))
        assert streams.shape == (length, core.config.hc_count * core.config.hidden_size)
        drafts, draft_logits, first = head.draft(core, streams[:-1], ids, k=4)
        whole_streams, whole = head.step(core, streams[:-1], ids[1:], torch.arange(length - 1), MTPCache())
    assert first.shape == whole.shape == (length - 1, core.config.vocab_size)
    torch.testing.assert_close(first, whole, rtol=1e-5, atol=1e-5)
    assert len(drafts) == 4 and draft_logits.shape == (4, core.config.vocab_size)
    torch.testing.assert_close(draft_logits[0], first[-1])
    assert drafts == draft_logits.argmax(-1).tolist()
    # the head depends on both inputs: other target streams or another token change its logits
    with torch.no_grad():
        _, other_streams = head.step(core, streams[:1].flip(-1), ids[1:2], torch.arange(1), MTPCache())
        _, other_token = head.step(core, streams[:1], ids[2:3], torch.arange(1), MTPCache())
        _, same = head.step(core, streams[:1], ids[1:2], torch.arange(1), MTPCache())
    torch.testing.assert_close(same[0], first[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(other_streams, same) and not torch.allclose(other_token, same)
    assert whole_streams.shape == streams[:-1].shape


def test_served_model_keeps_the_pre_mixer_streams_for_mtp(served: Any) -> None:  # noqa: F811
    from vllm.forward_context import set_forward_context

    model, vllm_config = served
    assert model.get_mtp_target_hidden_states() is None  # no MTP head drafts: nothing kept
    hc, width = model.config.hc_count, model.config.hidden_size
    ids, positions = torch.randint(0, 248_000, (7,)), torch.arange(7)
    model.model.keep_mtp_target_streams(16, torch.float32)
    try:
        with set_forward_context(None, vllm_config), torch.no_grad():
            hidden = model(ids, positions)
            kept = model.get_mtp_target_hidden_states()
            streams = hyper_connection.hc_expand(model.model.embed_tokens(ids), hc)
            for layer in model.model.layers:
                streams, pending = layer(streams, None, positions, ids)
                streams = hyper_connection.hc_inject(streams, *pending)
            mixed, _ = model.model.hyper_connection_mixer.mix(streams)
    finally:
        model.model.mtp_target_streams = None
    assert kept is not None and kept.shape == (16, hc * width)
    torch.testing.assert_close(kept[:7], streams, rtol=0, atol=1e-6)
    torch.testing.assert_close(hidden, mixed, rtol=0, atol=1e-6)
