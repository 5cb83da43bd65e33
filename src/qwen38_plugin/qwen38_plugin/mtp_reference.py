"""The checkpoint's multi-token-prediction head (``mtp.*``) in plain torch: the tests' oracle.

transformers' Qwen4Exp ignores ``mtp.*`` (``_keys_to_ignore_on_load_unexpected``), so the semantics
are stock vLLM's `Qwen4ExpMTP` (``vllm/models/qwen4_exp/nvidia/mtp.py``), computed here with the
reference blocks of `qwen38_plugin.model`, one token at a time. At position p the head reads the
target's residual streams before its final mixer (``[hc * H]``, `Qwen4ExpCore.forward_streams`)
and the token at p + 1:

- ``e = fc_embedding(norm_e(embed(token)))`` (``[H]``; the target's embedding table);
- ``s = fc_hidden(norm_h(streams))``: ``pre_fc_norm_hidden`` over the whole ``hc * H`` width, then
  ``fc_hidden`` shared by the ``hc`` streams;
- the decoder layer (``layers[step % mtp_num_hidden_layers]``: QSA attention with its own K/V and
  indexer keys, MoE, hyper-connections, no PLE) on the streams ``s + e`` (the embedding added to
  every stream with unit weight: stock's pending combine without injection weights);
- the head's final mixer (``hyper_connection_mixer``, no injection) gives the hidden state for the
  lm_head (``mtp.shared_head.head`` when the checkpoint has one, else the target's);
- the layer's output streams (before that mixer) are what the next draft step reads in place of
  the target's.

No tensor parallelism (one rank): this is an oracle, not a served model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qwen38_plugin.model import (
    _EXPERT_PARTS,
    CheckpointError,
    ConfigError,
    GatedResidual,
    QSAAttention,
    QSAPast,
    Qwen4ExpCore,
    SparseMoe,
    TensorParallel,
    _linear,
    _Norm,
)
from qwen38_plugin.ops import hyper_connection, qsa
from qwen38_plugin.ops.common import rms_norm


def mtp_layer_count(config: Any) -> int:
    return int(getattr(config, "mtp_num_hidden_layers", None) or getattr(config, "num_nextn_predict_layers", 0) or 0)


class MTPDecoderLayer(nn.Module):
    """A QSA decoder layer without PLE (stock builds it with ``layer_type="qwen_sparse_attention"``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self_attn = QSAAttention(config)
        self.mlp = SparseMoe(config, TensorParallel())
        self.attn_hyper_connection = GatedResidual(config)
        self.mlp_hyper_connection = GatedResidual(config)


@dataclass
class MTPCache:
    """One sequence's K/V and indexer keys, per MTP layer."""

    kv: dict[int, QSAPast] = field(default_factory=dict)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, indexer: qsa.IndexerStep | None) -> None:
        old_k, old_v, old_indexer = self.kv.get(layer, (None, None, None))
        past_indexer = None
        if indexer is not None:
            old_keys = [] if old_indexer is None else [old_indexer.block_keys]
            past_indexer = qsa.IndexerPast(torch.cat([*old_keys, indexer.block_keys]), indexer.open_keys)
        self.kv[layer] = (
            k if old_k is None else torch.cat([old_k, k]),
            v if old_v is None else torch.cat([old_v, v]),
            past_indexer,
        )


class Qwen4ExpMTPReference(nn.Module):
    """The ``mtp.*`` tensors (parameter names = checkpoint names without ``mtp.``) and the head's step."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        count = mtp_layer_count(config)
        if count < 1:
            raise ConfigError(
                f"mtp_num_hidden_layers: {count}; the checkpoint has no MTP head (set it to the number of mtp.layers)"
            )
        self.config = config
        h, width = config.hidden_size, config.hc_count * config.hidden_size
        self.fc_embedding = _linear(h, h)
        self.fc_hidden = _linear(h, h)
        self.pre_fc_norm_embedding = _Norm(h)
        self.pre_fc_norm_hidden = _Norm(width)
        self.layers = nn.ModuleList(MTPDecoderLayer(config) for _ in range(count))
        self.hyper_connection_mixer = GatedResidual(config, inject=False)
        self.shared_head: nn.Linear | None = None  # mtp.shared_head.head, when the checkpoint has one

    def step(
        self,
        core: Qwen4ExpCore,
        streams: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: MTPCache,
        layer_index: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Consecutive positions of one sequence: streams ``[N, hc * H]`` (the target's at those
        positions, or the previous draft step's), the next tokens ``[N]``, positions ``[N]`` ->
        (the layer's output streams ``[N, hc * H]``, logits ``[N, V]``). Appends to ``cache``."""
        c = self.config
        hc, h, eps = c.hc_count, c.hidden_size, c.rms_norm_eps
        embeds = F.linear(rms_norm(core.model.embed(token_ids), self.pre_fc_norm_embedding.weight, eps),
                          self.fc_embedding.weight)  # fmt: skip
        normed = rms_norm(streams, self.pre_fc_norm_hidden.weight, eps)
        projected = F.linear(normed.unflatten(-1, (hc, h)), self.fc_hidden.weight).flatten(-2)
        streams = projected + hyper_connection.hc_expand(embeds, hc)
        layer = self.layers[layer_index % len(self.layers)]
        assert isinstance(layer, MTPDecoderLayer)
        x, inject = layer.attn_hyper_connection.mix(streams)
        assert inject is not None
        attn = layer.self_attn
        prepared = attn.prepare(x, positions)
        out, k, v, keys = attn.attend(prepared, positions, cache.kv.get(layer_index, (None, None, None)))
        cache.append(layer_index, k, v, keys)
        streams = hyper_connection.hc_inject(streams, attn.o_proj(out), inject)
        x, inject = layer.mlp_hyper_connection.mix(streams)
        assert inject is not None
        streams = hyper_connection.hc_inject(streams, layer.mlp(x), inject)
        hidden, _ = self.hyper_connection_mixer.mix(streams)
        head = self.shared_head.weight if self.shared_head is not None else core.lm_head.weight
        return streams, F.linear(hidden, head)

    def draft(
        self, core: Qwen4ExpCore, target_streams: torch.Tensor, token_ids: torch.Tensor, k: int
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """What an MTP proposer drafts after a sequence ``token_ids [L]`` whose target streams are
        ``target_streams [L - 1, hc * H]`` (positions 0 .. L - 2; the last token is the one just
        sampled): the head reads every position once, token by token (position p with token
        p + 1), then drafts ``k`` tokens greedily, each step reading its own output streams.

        Returns (the k draft tokens, their logits ``[k, V]``, the teacher-forced logits ``[L - 1, V]``
        of the first pass)."""
        cache = MTPCache()
        first: list[torch.Tensor] = []
        streams = target_streams[:0]
        for p in range(token_ids.shape[0] - 1):
            position = torch.tensor([p])
            streams, logits = self.step(core, target_streams[p : p + 1], token_ids[p + 1 : p + 2], position, cache)
            first.append(logits)
        drafts, draft_logits = [], [first[-1]]
        position_now = token_ids.shape[0] - 2
        for j in range(1, k + 1):
            token = draft_logits[-1].argmax(-1)
            drafts.append(int(token))
            if j == k:
                break
            # vLLM's V1 proposer runs the head's layer 0 at every draft step (no spec_step_idx).
            streams, logits = self.step(core, streams, token, torch.tensor([position_now + j]), cache)
            draft_logits.append(logits)
        return drafts, torch.cat(draft_logits), torch.cat(first)

    def load_checkpoint_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the checkpoint's ``mtp.*`` tensors in (others are ignored); raise `CheckpointError`
        naming missing or unexpected ones. Per-expert tensors are stacked as the target's are."""
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        for name, tensor in tensors:
            name = name.removeprefix("model.language_model.").removeprefix("language_model.").removeprefix("model.")
            if not name.startswith("mtp."):
                continue
            name = name.removeprefix("mtp.")
            if name == "shared_head.head.weight":
                self.shared_head = _linear(*tensor.shape)
                self.shared_head.weight.data.copy_(tensor)
                continue
            if name.endswith("block_inject_weight.weight") and name.startswith("hyper_connection_mixer."):
                continue  # stock drops it too: the final mixer has no injection
            parts = name.split(".")
            if ".mlp.experts." in name and parts[-3].isdigit():
                experts.setdefault(".".join(parts[:-3]), {}).setdefault(int(parts[-3]), {})[parts[-2]] = tensor
                continue
            if name not in params or tuple(params[name].shape) != tuple(tensor.shape):
                unexpected.append(name)
                continue
            with torch.no_grad():
                params[name].copy_(tensor.to(params[name].dtype))
            loaded.add(name)
        for prefix, parts_of in experts.items():
            if sorted(parts_of) != list(range(self.config.num_experts)) or any(
                set(p) != set(_EXPERT_PARTS) for p in parts_of.values()
            ):
                unexpected.append(f"{prefix}.* (incomplete experts)")
                continue
            stacked = {
                f"{prefix}.gate_up_proj": torch.stack(
                    [torch.cat([parts_of[e]["gate_proj"], parts_of[e]["up_proj"]]) for e in sorted(parts_of)]
                ),
                f"{prefix}.down_proj": torch.stack([parts_of[e]["down_proj"] for e in sorted(parts_of)]),
            }
            for target, value in stacked.items():
                with torch.no_grad():
                    params[target].copy_(value.to(params[target].dtype))
                loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing or unexpected:
            raise CheckpointError(missing, sorted(unexpected))
        return loaded
