"""The portable Qwen4Exp exposes vLLM's auxiliary hidden states (the EAGLE-3 / DFlash target
features) reduced over its hyper-connection streams by ``hc_mean``.

vLLM's model runner asks a target that `supports_eagle3` for the layers a DFlash drafter names
(``dflash_config.target_layer_ids`` [j] -> auxiliary layer j + 1, the output of layer j) through
`set_aux_hidden_state_layers`, and then takes ``(hidden_states, [aux, ...])`` from its forward.
Built in this process without a step's metadata (as in test_qwen38_vllm_model.py): what is checked
is which residual state is exposed and how it is reduced; the engine tests check the numerics of
the residual state itself.
"""

from __future__ import annotations

from typing import Any

import torch

from qwen38_plugin.ops import hyper_connection
from tests.qwen38_plugin.test_qwen38_vllm_model import served  # noqa: F401  (the built model, a fixture)


def test_aux_hidden_states_are_the_mean_over_the_streams_entering_each_layer(served: Any) -> None:  # noqa: F811
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.models.interfaces import supports_eagle3

    model, vllm_config = served
    assert supports_eagle3(model)
    hc, width = model.config.hc_count, model.config.hidden_size
    num_layers = len(model.model.layers)
    ids, positions = torch.randint(0, 248_000, (7,)), torch.arange(7)
    with set_forward_context(None, vllm_config), torch.no_grad():
        plain = model(ids, positions)
        assert isinstance(plain, torch.Tensor)  # no layers asked for: the forward is unchanged
        # the residual state entering each layer, and after the last one, computed here layer by layer
        streams = hyper_connection.hc_expand(model.model.embed_tokens(ids), hc)
        entering = [streams]
        for layer in model.model.layers:
            # a layer hands on its MoE output and injection weights unapplied (the next norm adds them)
            streams, pending = layer(streams, None, positions, ids)
            streams = hyper_connection.hc_inject(streams, *pending)
            entering.append(streams)
        asked = (num_layers, 0, 2)  # a DFlash drafter with target_layer_ids [-1, 1, num_layers - 1]
        model.set_aux_hidden_state_layers(asked)
        try:
            hidden, aux = model(ids, positions)
        finally:
            model.set_aux_hidden_state_layers(())
        assert isinstance(model(ids, positions), torch.Tensor)
    assert torch.equal(hidden, plain)
    assert len(aux) == 3
    for got, index in zip(aux, sorted(asked), strict=True):
        state = entering[index].view(7, hc, width)
        assert got.shape == (7, width)
        assert torch.allclose(got, state.mean(dim=1), rtol=0, atol=1e-6), index
    last = entering[num_layers].view(7, hc, width)
    assert not torch.allclose(last[:, 0], last.mean(dim=1))  # the streams differ: the mean is not one stream


def test_aux_hidden_states_trace_as_one_graph(served: Any) -> None:  # noqa: F811
    """What vLLM's torch.compile needs on CUDA: the forward with auxiliary outputs still traces whole."""
    from vllm.forward_context import set_forward_context

    model, vllm_config = served
    torch._dynamo.reset()
    model.set_aux_hidden_state_layers((1, 3))
    try:
        compiled = torch.compile(model.model.forward, fullgraph=True, backend="eager", dynamic=True)
        with set_forward_context(None, vllm_config), torch.no_grad():
            ids, positions = torch.randint(0, 248_000, (9,)), torch.arange(9)
            hidden, aux = compiled(ids, positions)
            expected_hidden, expected_aux = model.model.forward(ids, positions)
    finally:
        model.set_aux_hidden_state_layers(())
        torch._dynamo.reset()
    assert torch.equal(hidden, expected_hidden)
    assert len(aux) == 2 and all(torch.equal(a, b) for a, b in zip(aux, expected_aux, strict=True))
