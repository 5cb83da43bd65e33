"""A plain-torch DFlash drafter with stock vLLM's serving semantics, for training and checking.

Stock vLLM 0.32 serves a DFlash drafter (architecture ``DFlashDraftModel``) as
``vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM``, driven by its DFlash proposer
(V1: ``vllm.v1.spec_decode.dflash``; V2: ``vllm.v1.worker.gpu.spec_decode.dflash``). What one
drafting step computes for a request whose last sampled (bonus) token sits at position ``a``:

- **Target features.** The target hands over its auxiliary hidden states at the layers
  ``dflash_config.target_layer_ids`` names, each id ``j`` meaning auxiliary index ``j + 1``: the
  residual state entering target layer ``j + 1``, i.e. the output of layer ``j`` (stock adds the
  one when it reads the config; `aux_layer_indices`). A hyper-connection target (Qwen4Exp) hands
  over the mean of its residual streams there (``target_feature_reduction = "hc_mean"``). They are
  concatenated in increasing layer order and projected by ``fc`` (no bias) to the drafter's width.
- **Context.** Every target position the target has verified and kept, ``0 .. a - 1``, is a context
  row at its own position. Context rows never pass through the drafter's layers: each layer makes
  keys and values from ``hidden_norm(fc(features))`` with its own ``k_proj`` / ``v_proj``, ``k_norm``
  on the keys and RoPE at the row's position, and writes them to its KV cache.
- **Query block.** ``1 + N`` tokens (``N = num_speculative_tokens``): the bonus token at position
  ``a`` and ``N`` copies of ``dflash_config.mask_token_id`` at ``a + 1 .. a + N``, embedded by the
  target's token embedding (shared; no drafter embedding). They run through the drafter's Qwen3
  decoder layers (pre-norm attention and SwiGLU MLP, per-head ``q_norm`` / ``k_norm``, neox RoPE),
  attending to all context rows and, within the block, causally (``dflash_config.causal`` true) or
  to the whole block (false), then the final ``norm``.
- **Drafts.** The block's rows ``1 .. N`` go through the target's lm_head (shared); row ``k``'s
  argmax is the draft for position ``a + k``. The bonus row drafts nothing.
- **A reduced draft vocabulary** (``draft_vocab_size`` below the target's ``vocab_size``): the
  drafter then has its own ``lm_head`` of ``draft_vocab_size`` rows and a ``d2t`` tensor; draft row
  ``i`` stands for target token ``i + d2t[i]``. Stock scatters the drafter's logits to those target
  ids and fills every other id with ``-inf``, so a draft is always one of the drafter's tokens. The
  point is speed: the drafter's logits cost a GEMV over the whole vocabulary every step (0.18 ms of
  a 2.9 ms DFlash step on the medium config, 2026-12-06); 16,384 of its 248,320 rows read 6.6 % of
  the bytes.

`DFlashDrafterReference` holds exactly the drafter checkpoint's tensors under their on-disk names
(``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.self_attn.q_proj.weight``, ...; no embedding;
``lm_head.weight`` and ``d2t`` only with a reduced draft vocabulary), so ``state_dict()`` is what
vLLM loads. Its `forward` takes many query blocks at once with one attention mask
(`block_attention_mask`), so training runs every block of a sequence in one pass; `draft_logits` is
the one-request step above. Options of stock's module this reference does not model (sliding
windows, attention or output biases, value scale, sink bias, a separate mask embedding, interleaved
RoPE) are refused in `DrafterGeometry.from_config`.

Plain torch only: importable without vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class DrafterReferenceError(ValueError):
    """A drafter config this reference cannot model; the message names the field."""


def _layer_causal(config: Mapping[str, Any], layer: int) -> bool:
    # stock's precedence: a top-level is_causal, then dflash_config.causal, then sliding layer types
    if config.get("is_causal") is not None:
        return bool(config["is_causal"])
    dflash = config.get("dflash_config") or {}
    if dflash.get("causal") is not None:
        return bool(dflash["causal"])
    layer_types = config.get("layer_types") or []
    return bool(layer_types) and layer_types[layer] == "sliding_attention"


def aux_layer_indices(config: Mapping[str, Any]) -> list[int]:
    """The target's auxiliary hidden-state indices the drafter reads, in the order vLLM concatenates
    them: ``dflash_config.target_layer_ids`` ``j`` -> ``j + 1`` (the residual state entering layer
    ``j + 1``), sorted, as a target collects them while walking its layers."""
    ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    if not ids:
        raise DrafterReferenceError("dflash_config.target_layer_ids: missing or empty")
    return sorted(int(i) + 1 for i in ids)


@dataclass(frozen=True)
class DrafterGeometry:
    hidden_size: int
    target_hidden_size: int
    num_aux: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    mask_token_id: int
    causal: tuple[bool, ...]
    vocab_size: int
    draft_vocab_size: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DrafterGeometry:
        dflash = config.get("dflash_config") or {}
        unsupported = {
            "attention_bias": bool(config.get("attention_bias", False)),
            "dflash_config.use_swa": bool(dflash.get("use_swa", False)),
            "layer_types (sliding_attention)": "sliding_attention" in (config.get("layer_types") or []),
            "dflash_config.attention_value_scale": dflash.get("attention_value_scale") is not None,
            "dflash_config.attention_sink_bias": bool(dflash.get("attention_sink_bias", False)),
            "is_neox_style false": not config.get("is_neox_style", True),
            "dflash_config.use_aux_hidden_state false": not dflash.get("use_aux_hidden_state", True),
            "logit_scale != 1": float(config.get("logit_scale", 1.0)) != 1.0,
        }
        refused = [name for name, present in unsupported.items() if present]
        if refused:
            raise DrafterReferenceError(f"drafter config: not modeled by this reference: {', '.join(refused)}")
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise DrafterReferenceError(f"rope_parameters: only full default RoPE is modeled, got {rope}")
        if "mask_token_id" in dflash:
            mask = int(dflash["mask_token_id"])
        elif config.get("mask_token_id") is not None:
            mask = int(config["mask_token_id"])
        else:
            raise DrafterReferenceError("dflash_config.mask_token_id: missing")
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        vocab = int(config["vocab_size"])
        draft_vocab = vocab if config.get("draft_vocab_size") is None else int(config["draft_vocab_size"])
        if not 0 < draft_vocab <= vocab:
            raise DrafterReferenceError(
                f"draft_vocab_size: {draft_vocab} is outside 1..vocab_size ({vocab}); "
                "leave it out for the full vocabulary"
            )
        return cls(
            hidden_size=hidden,
            target_hidden_size=int(config.get("target_hidden_size") or hidden),
            num_aux=len(aux_layer_indices(config)),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config["num_key_value_heads"]),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 1_000_000.0))),
            mask_token_id=mask,
            causal=tuple(_layer_causal(config, i) for i in range(layers)),
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
        )

    @property
    def reduced_vocab(self) -> bool:
        """The drafter has its own lm_head over ``draft_vocab_size`` target tokens (``d2t``)."""
        return self.draft_vocab_size != self.vocab_size


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm (a plain multiplicative weight), computed in float32 as vLLM's kernel is."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding of ``x [..., T, heads, d]`` at ``positions [..., T]``."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.float().unsqueeze(-1) * inv_freq  # [..., T, d / 2]
    cos, sin = angles.cos().unsqueeze(-2), angles.sin().unsqueeze(-2)  # broadcast over heads
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, g: DrafterGeometry) -> None:
        super().__init__()
        self.g = g
        self.q_proj = nn.Linear(g.hidden_size, g.num_heads * g.head_dim, bias=False)
        self.k_proj = nn.Linear(g.hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.v_proj = nn.Linear(g.hidden_size, g.num_kv_heads * g.head_dim, bias=False)
        self.o_proj = nn.Linear(g.num_heads * g.head_dim, g.hidden_size, bias=False)
        self.q_norm = RMSNorm(g.head_dim, g.rms_norm_eps)
        self.k_norm = RMSNorm(g.head_dim, g.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed, rotated keys and values ``[B, T, kv_heads, d]`` of ``x [B, T, H]``."""
        g = self.g
        k = self.k_norm(self.k_proj(x).unflatten(-1, (g.num_kv_heads, g.head_dim)))
        v = self.v_proj(x).unflatten(-1, (g.num_kv_heads, g.head_dim))
        return rope(k, positions, g.rope_theta), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        attend: torch.Tensor,
    ) -> torch.Tensor:
        g = self.g
        q = rope(self.q_norm(self.q_proj(x).unflatten(-1, (g.num_heads, g.head_dim))), positions, g.rope_theta)
        k, v = self.keys_values(x, positions)
        # keys: the context rows first, then the query rows (the mask's column order)
        k = torch.cat((context_kv[0], k), dim=1)
        v = torch.cat((context_kv[1], v), dim=1)
        repeat = g.num_heads // g.num_kv_heads
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, d]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend.unsqueeze(1), scale=g.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class _MLP(nn.Module):
    def __init__(self, g: DrafterGeometry) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.up_proj = nn.Linear(g.hidden_size, g.intermediate_size, bias=False)
        self.down_proj = nn.Linear(g.intermediate_size, g.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, g: DrafterGeometry) -> None:
        super().__init__()
        self.self_attn = _Attention(g)
        self.mlp = _MLP(g)
        self.input_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(g.hidden_size, g.rms_norm_eps)


class DFlashDrafterReference(nn.Module):
    """Stock vLLM's ``DFlashQwen3ForCausalLM`` in plain torch (see the module docstring)."""

    lm_head: nn.Linear  # (with a reduced draft vocabulary only, as d2t)
    d2t: torch.Tensor

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        self.geometry = g = DrafterGeometry.from_config(config)
        self.fc = nn.Linear(g.num_aux * g.target_hidden_size, g.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(g) for _ in range(g.num_layers))
        self.norm = RMSNorm(g.hidden_size, g.rms_norm_eps)
        if g.reduced_vocab:
            # draft row i is target token i + d2t[i] (stock's convention: the offset, not the id)
            self.lm_head = nn.Linear(g.hidden_size, g.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(g.draft_vocab_size, dtype=torch.long))

    def set_draft_vocabulary(self, token_ids: Sequence[int] | torch.Tensor, target_lm_head: torch.Tensor) -> None:
        """Make the draft vocabulary the target tokens ``token_ids`` (distinct, ``draft_vocab_size``
        of them, in the order of the draft rows), with the target's lm_head rows for them."""
        g = self.geometry
        if not g.reduced_vocab:
            raise DrafterReferenceError("set_draft_vocabulary: draft_vocab_size is the full vocabulary")
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.d2t.device)
        if ids.shape != (g.draft_vocab_size,) or ids.unique().numel() != ids.numel():
            raise DrafterReferenceError(
                f"set_draft_vocabulary: need {g.draft_vocab_size} distinct token ids, got {ids.numel()} "
                f"({ids.unique().numel()} distinct)"
            )
        if int(ids.min()) < 0 or int(ids.max()) >= g.vocab_size:
            raise DrafterReferenceError(f"set_draft_vocabulary: token ids must lie in 0..{g.vocab_size - 1}")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
            self.lm_head.weight.copy_(target_lm_head[ids.to(target_lm_head.device)])

    def draft_token_ids(self) -> torch.Tensor:
        """The target token id of each draft row ``[draft_vocab_size]`` (all ids when not reduced)."""
        g = self.geometry
        if not g.reduced_vocab:
            return torch.arange(g.vocab_size, device=self.fc.weight.device)
        return self.d2t + torch.arange(g.draft_vocab_size, device=self.d2t.device)

    def logits(self, hidden: torch.Tensor, target_lm_head: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary ``[..., vocab_size]`` for final hidden states
        ``[..., H]``: the target's lm_head, or the drafter's own over its draft tokens with ``-inf``
        at every other id (stock's ``compute_logits``)."""
        g = self.geometry
        if not g.reduced_vocab:
            return hidden @ target_lm_head.t()
        own = hidden @ self.lm_head.weight.to(hidden.dtype).t()
        full = own.new_full((*own.shape[:-1], g.vocab_size), float("-inf"))
        full[..., self.draft_token_ids()] = own
        return full

    def reset_parameters(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Random linear weights (normal, ``std``) and unit norm weights: a fresh drafter (a reduced
        vocabulary's lm_head too: `set_draft_vocabulary` gives it the target's rows)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) * std)

    def context_states(self, aux_features: torch.Tensor) -> torch.Tensor:
        """``fc`` over the concatenated target features ``[..., num_aux * target_hidden]``."""
        return self.fc(aux_features)

    def forward(
        self,
        context_states: torch.Tensor,
        context_positions: torch.Tensor,
        query_embeds: torch.Tensor,
        query_positions: torch.Tensor,
        attend: torch.Tensor,
    ) -> torch.Tensor:
        """Final hidden states ``[B, Q, H]`` of the query rows.

        ``context_states [B, C, H]`` (`context_states` of the target features) at
        ``context_positions [B, C]``; ``query_embeds [B, Q, H]`` (target embeddings of the blocks'
        tokens) at ``query_positions [B, Q]``; ``attend [B or 1, Q, C + Q]`` (bool): which context
        rows, then which query rows, each query row sees (`block_attention_mask`).
        """
        normed_context = self.hidden_norm(context_states)
        h = query_embeds
        for layer in self.layers:
            assert isinstance(layer, _Layer)
            context_kv = layer.self_attn.keys_values(normed_context, context_positions)
            h = h + layer.self_attn(layer.input_layernorm(h), query_positions, context_kv, attend)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def draft_logits(
        self,
        aux_features: torch.Tensor,
        tokens: Sequence[int] | torch.Tensor,
        num_drafts: int,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
    ) -> torch.Tensor:
        """One drafting step for one request, as vLLM runs it: ``tokens`` are the request's tokens so
        far, the last one the bonus token (position ``a = len(tokens) - 1``); ``aux_features [>= a,
        num_aux * target_hidden]`` the target's features at positions ``0 ..``. Returns the logits
        ``[num_drafts, vocab]`` of the drafts for positions ``a + 1 .. a + num_drafts`` (`logits`:
        ``lm_head_weight`` is the target's, unused with a reduced draft vocabulary)."""
        g = self.geometry
        ids = torch.as_tensor(tokens, dtype=torch.long, device=aux_features.device)
        a = ids.numel() - 1
        block = torch.full((1 + num_drafts,), g.mask_token_id, dtype=torch.long, device=ids.device)
        block[0] = ids[a]
        positions = torch.arange(a + 1 + num_drafts, device=ids.device)
        attend = block_attention_mask([a], a, 1 + num_drafts, all(g.causal), device=ids.device)
        hidden = self(
            self.context_states(aux_features[:a]).unsqueeze(0),
            positions[:a].unsqueeze(0),
            F.embedding(block, embed_weight).unsqueeze(0),
            positions[a:].unsqueeze(0),
            attend.unsqueeze(0),
        )
        return self.logits(hidden[0, 1:], lm_head_weight)


def block_attention_mask(
    anchors: Sequence[int], num_context: int, block_size: int, causal: bool, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[len(anchors) * block_size, num_context + len(anchors) * block_size]`` (bool): block ``i``
    (anchor at position ``anchors[i]``; context row ``c`` is position ``c``) sees the context rows
    before its anchor and, within itself, the rows up to its own (``causal``) or all of them; blocks
    do not see each other. Many blocks of one sequence in one mask is what one vLLM step per anchor
    would compute, batched."""
    n = len(anchors)
    anchor = torch.as_tensor(list(anchors), dtype=torch.long, device=device)
    rows = n * block_size
    context = torch.arange(num_context, device=device)
    sees_context = (context.unsqueeze(0) < anchor.unsqueeze(1)).repeat_interleave(block_size, dim=0)
    block_of = torch.arange(rows, device=device) // block_size
    offset = torch.arange(rows, device=device) % block_size
    same_block = block_of.unsqueeze(1) == block_of.unsqueeze(0)
    within = same_block & (offset.unsqueeze(0) <= offset.unsqueeze(1)) if causal else same_block
    return torch.cat((sees_context, within), dim=1)


def anchor_blocks(
    tokens: torch.Tensor, anchors: Sequence[int], block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query blocks of one sequence ``tokens [T]`` at ``anchors`` (each ``<= T - block_size``):
    their token ids ``[n * block_size]`` (the anchor's token, then mask tokens), positions
    ``[n * block_size]`` and labels ``[n, block_size - 1]`` (the tokens the drafts should be)."""
    anchor = torch.as_tensor(list(anchors), dtype=torch.long, device=tokens.device)
    offsets = torch.arange(block_size, device=tokens.device)
    positions = anchor.unsqueeze(1) + offsets  # [n, block]
    ids = torch.full_like(positions, mask_token_id)
    ids[:, 0] = tokens[anchor]
    return ids.flatten(), positions.flatten(), tokens[positions[:, 1:]]


def expected_acceptance_length(correct: torch.Tensor) -> float:
    """Greedy verification keeps the drafts up to the first wrong one, plus the target's own token:
    ``1 +`` the mean leading run of ``correct [blocks, drafts]`` (bool)."""
    return 1.0 + float(correct.float().cumprod(dim=1).sum(dim=1).mean()) if correct.numel() else math.nan


def qwen4exp_aux_features(core: Any, sequences: Sequence[torch.Tensor], indices: Sequence[int]) -> list[torch.Tensor]:
    """The target features a Qwen4Exp target hands a DFlash drafter: for each sequence of token ids
    ``[T]``, the ``hc_mean`` of the residual streams entering each layer in ``indices``
    (`aux_layer_indices`; ``num_hidden_layers``: after the last layer, before the final mixer),
    concatenated ``[T, len(indices) * H]``, from one forward of the plain-torch oracle ``core``
    (`qwen38_plugin.model.Qwen4ExpCore.forward_streams`; call under ``torch.no_grad()``). The
    sequences run together, as prefills of one step.
    """
    from qwen38_plugin.model import DictStateStore, SequenceCache
    from qwen38_plugin.ops import hyper_connection

    config = core.config
    depth = config.num_hidden_layers
    bad = [i for i in indices if not 0 <= i <= depth]
    if bad:
        raise DrafterReferenceError(f"auxiliary layer indices {bad} are outside 0..{depth} of the target")
    lengths = [int(s.numel()) for s in sequences]
    token_ids = torch.cat(list(sequences))
    positions = torch.cat([torch.arange(n, device=token_ids.device) for n in lengths])
    entering: dict[int, torch.Tensor | None] = dict.fromkeys(indices)
    core.forward_streams(
        token_ids, positions, lengths, DictStateStore(core, [SequenceCache() for _ in lengths]), entering
    )
    features = []
    for index in indices:
        streams = entering[index]
        assert streams is not None
        features.append(hyper_connection.hc_mean(streams, config.hc_count))
    return list(torch.cat(features, dim=-1).split(lengths))
