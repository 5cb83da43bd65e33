"""The stateful parts of the portable Qwen4Exp model as vLLM custom ops.

Each op takes the step's tensors and the name of the layer that owns the caches; the layer
finds its per-step metadata (built once per step by its attention backend's builder) and its
caches through vLLM's forward context. To torch.compile they are opaque calls that write into
an output buffer (as vLLM's own attention and GDN ops), so everything between them — the
projections, norms, rotary embeddings, hyper-connections and MoE routing — is compiled and fused,
and the whole decode step is captured in one CUDA graph.

| op | owner (in the forward context) | what it does |
|---|---|---|
| ``vllm.qwen38_qsa_attention`` | `vllm_qsa.PortableQSAAttention` | cache writes, indexer top-k, sparse attention |
| ``vllm.qwen38_ple_embed`` | `vllm_ple.PortablePLE` | n-gram rows (advancing the n-gram context) and the table lookup |
| ``vllm.qwen38_ple_mix`` | `vllm_ple.PortablePLE` | gated value and dilated convolution (advancing the conv state) |
| ``vllm.qwen38_gdn_core_cpu`` | `vllm_gdn.PortableGatedDeltaNet` | the GDN core on CPU (CUDA uses vLLM's own GDN op) |

vLLM runs CUDA graphs in one of two ways, and the ops are correct in both: with torch.compile,
the ops are splitting ops (`SPLITTING_OPS`, run between piecewise graphs); with breakable CUDA
graphs (vLLM's default for the ``Qwen4ExpForCausalLM`` architecture on CUDA: compilation off, one
capture broken at each marked op), they are marked with `eager_break_during_capture`. Full graphs
of uniform decode steps capture them whole in both.

In vLLM's profiling run there is no metadata: the ops write zeros, so the run still goes
through every projection and sizes memory from a real peak.
"""

# No `from __future__ import annotations`: torch infers the ops' schemas from the live annotations.
from typing import Any, Optional

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import (
    LayerNameType,
    _encode_layer_name,
    _resolve_layer_name,
    direct_register_custom_op,
)


def layer_name(name: str) -> Any:
    """A layer name as the ops take it (vLLM may wrap it so compiled graphs do not specialise on it)."""
    return _encode_layer_name(name)


def register_owner(vllm_config: Any, name: str, owner: Any) -> Any:
    """Put ``owner`` in vLLM's forward context under ``name`` (where the ops find it); returns the
    name as the ops take it. Registers the ops on first use."""
    register_ops()
    compilation = vllm_config.compilation_config
    context = compilation.static_forward_context
    if name in context:
        raise ValueError(f"Duplicate layer name: {name}")
    context[name] = owner
    # vLLM captures the pieces between its splitting ops as piecewise CUDA graphs and replays
    # them for every batch of that size, prefills included; our ops read per-request metadata,
    # so, like stock's attention and GDN ops, they must run outside those pieces.
    if compilation.splitting_ops is not None:
        compilation.splitting_ops.extend(op for op in SPLITTING_OPS if op not in compilation.splitting_ops)
    return layer_name(name)


def step_metadata(name: str) -> Any:
    """The step's metadata of the cache layer ``name``, or None (vLLM's profiling run has none)."""
    metadata = get_forward_context().attn_metadata
    return metadata.get(name) if isinstance(metadata, dict) else None


def _owner(name: Any) -> Any:
    return get_forward_context().no_compile_layers[_resolve_layer_name(name)]


def qwen38_qsa_attention(
    q: torch.Tensor,
    gate: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_q: Optional[torch.Tensor],  # noqa: UP045 (torch's schema inference reads typing.Optional)
    raw_keys: Optional[torch.Tensor],  # noqa: UP045
    positions: torch.Tensor,
    out: torch.Tensor,
    layer_name: LayerNameType,
) -> None:
    _owner(layer_name).attend(q, gate, k, v, index_q, raw_keys, positions, out)


def qwen38_ple_embed(input_ids: torch.Tensor, embedded: torch.Tensor, layer_name: LayerNameType) -> None:
    _owner(layer_name).embed(input_ids, embedded)


def qwen38_ple_mix(
    streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, term: torch.Tensor, layer_name: LayerNameType
) -> None:
    _owner(layer_name).mix(streams, key, value, term)


def qwen38_gdn_core_cpu(
    mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core_out: torch.Tensor, layer_name: LayerNameType
) -> None:
    _owner(layer_name).core_cpu(mixed_qkv, b, a, core_out)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


_REGISTERED = False
SPLITTING_OPS = tuple(
    f"vllm::{op}" for op in ("qwen38_qsa_attention", "qwen38_ple_embed", "qwen38_ple_mix", "qwen38_gdn_core_cpu")
)


def register_ops() -> None:
    """Register the ops once per process (model construction calls it; cheap afterwards)."""
    global _REGISTERED
    if _REGISTERED:
        return
    for op, mutated in (
        (qwen38_qsa_attention, ["out"]),
        (qwen38_ple_embed, ["embedded"]),
        (qwen38_ple_mix, ["term"]),
        (qwen38_gdn_core_cpu, ["core_out"]),
    ):
        direct_register_custom_op(op.__name__, eager_break_during_capture(op), mutates_args=mutated, fake_impl=_nothing)
    _REGISTERED = True
