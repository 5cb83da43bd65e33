"""What the served model refuses at startup (`vllm_startup.check_vllm_config`), on vLLM's own
config objects built from tiny checkpoints by `EngineArgs` (no engine is started): each refusal
names the option or field and the fix, and arrives while vLLM builds its config (the config hook).
And what it accepts: a config without ``output_gate_type`` follows transformers (``hidden_act``)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.qwen38_plugin.mm_checkpoint import mm_model_checkpoint


def _engine_config(model: Path, **kwargs: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=256, **kwargs).create_engine_config()


def _edited_copy(source: Path, target: Path, **fields: Any) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    text.update(fields)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    from qwen38_plugin import register

    register()
    return tiny_checkpoint("qwen4_exp_text", dtype="float32")


def test_accepts_the_tiny_checkpoint_on_cpu_and_fp16_on_cuda(checkpoint: Path) -> None:
    from qwen38_plugin.vllm_startup import check_vllm_config

    check_vllm_config(_engine_config(checkpoint, dtype="float32"))
    check_vllm_config(_engine_config(checkpoint, dtype="float16"), on_cuda=True)


def test_refuses_float32_on_cuda_naming_the_option(checkpoint: Path) -> None:
    from qwen38_plugin.model import ConfigError
    from qwen38_plugin.vllm_startup import check_vllm_config

    with pytest.raises(ConfigError, match=r"--dtype float32: .* serve with --dtype float16 or --dtype bfloat16"):
        check_vllm_config(_engine_config(checkpoint, dtype="float32"), on_cuda=True)


def test_refuses_a_rope_type_it_does_not_implement(checkpoint: Path, tmp_path: Path) -> None:
    # refused while vLLM builds the config (the config hook), wrapped by pydantic as stock's own errors are
    base = json.loads((checkpoint / "config.json").read_text())
    rope = dict(base.get("text_config", base)["rope_parameters"])
    rope.update(rope_type="yarn", factor=2.0, original_max_position_embeddings=128)
    model = _edited_copy(checkpoint, tmp_path / "yarn", rope_parameters=rope)
    with pytest.raises(ValueError, match=r"rope_parameters.rope_type: 'yarn' is not implemented .* unscaled RoPE"):
        _engine_config(model, dtype="float32")


def test_decode_context_parallelism_beside_speculation_only_for_mtp_on_cpu(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    # DCP splits the QSA layers' K/V (test_qwen38_tp_engine.py serves it), and the MTP head's in vLLM's
    # V1 runner on CPU (test_qwen38_mtp_drafts_engine.py serves it); elsewhere speculation beside it is
    # refused naming both options. One KV head: vLLM wants more tensor-parallel ranks than KV heads for DCP.
    from qwen38_plugin.vllm_startup import check_vllm_config

    one_kv_head = {"num_key_value_heads": 1}
    dcp = {"dtype": "float32", "tensor_parallel_size": 2, "decode_context_parallel_size": 2}
    check_vllm_config(_engine_config(tiny_checkpoint("qwen4_exp_text", overrides=one_kv_head, dtype="float32"), **dcp))
    mtp = tiny_checkpoint("qwen4_exp_text", overrides={**one_kv_head, "mtp_num_hidden_layers": 1}, dtype="float32")
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    config = _engine_config(mtp, **dcp, speculative_config=spec, enable_prefix_caching=False)  # accepted on CPU
    config.model_config.dtype = torch.float16  # (float32 is refused on CUDA before)
    with pytest.raises(ValueError, match=r"-size 2 with --speculative-config on CUDA: .* drop one"):
        check_vllm_config(config, on_cuda=True)
    config.speculative_config.method = "dflash"
    with pytest.raises(ValueError, match=r"with --speculative-config with the 'dflash' method: .* only for MTP on CPU"):
        check_vllm_config(config, on_cuda=False)
    multimodal = _edited_copy(mm_model_checkpoint(), tmp_path / "mm", **one_kv_head, mtp_num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"multimodal \(M-RoPE\) checkpoint: .* drop one of the two"):
        _engine_config(multimodal, **dcp, speculative_config=spec, enable_prefix_caching=False)


def test_unset_output_gate_type_follows_hidden_act(checkpoint: Path, tmp_path: Path, vllm_single_rank: None) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    from qwen38_plugin.vllm_model import PortableQwen4ExpForCausalLM

    model_dir = _edited_copy(checkpoint, tmp_path / "gate", output_gate_type=None)
    vllm_config = _engine_config(model_dir, dtype="float32", enforce_eager=True)
    with pytest.MonkeyPatch.context() as env, set_current_vllm_config(vllm_config):
        env.setenv("QWEN38_PLE_TABLE", "device")
        model = initialize_model(vllm_config, model_class=PortableQwen4ExpForCausalLM)
    gates = {layer.linear_attn.norm.activation for layer in model.model.layers if hasattr(layer, "linear_attn")}
    assert gates == {model.config.hidden_act} == {"silu"}  # stock asserts on an unset field


def test_gdn_prefill_takes_triton_where_flashinfer_cannot_take_the_head_dims(checkpoint: Path) -> None:
    """vLLM's "auto" picks FlashInfer's GDN prefill on Hopper whatever the head dims, and that kernel
    raised "DSL kernel only supports D=128, got 32" at the first prefill of a tiny checkpoint on the
    H100 (2026-12-06, with FlashInfer installed). Unset, the backend becomes Triton there; asked
    for by name, FlashInfer is refused when the config is built, naming the option, the fields and
    the fix."""
    from qwen38_plugin.vllm_startup import gdn_prefill_backend

    assert gdn_prefill_backend(None, 128, 128, flashinfer_installed=True) is None
    assert gdn_prefill_backend("auto", 128, 128, flashinfer_installed=True) is None
    assert gdn_prefill_backend(None, 128, 128, flashinfer_installed=False) == "triton"
    assert gdn_prefill_backend(None, 32, 32, flashinfer_installed=True) == "triton"
    assert gdn_prefill_backend(None, 128, 64, flashinfer_installed=True) == "triton"
    assert gdn_prefill_backend("triton", 32, 32, flashinfer_installed=True) is None
    assert gdn_prefill_backend("flashinfer", 128, 128, flashinfer_installed=True) is None

    config = _engine_config(checkpoint, dtype="float32")  # the config hook settles it
    text = config.model_config.hf_text_config
    assert (text.linear_key_head_dim, text.linear_value_head_dim) != (128, 128)
    assert config.additional_config["gdn_prefill_backend"] == "triton"

    expected = (
        rf"--gdn-prefill-backend flashinfer .* linear_key_head_dim and linear_value_head_dim to be 128 .* "
        rf"has {text.linear_key_head_dim} and {text.linear_value_head_dim}\. .* --gdn-prefill-backend triton"
    )
    with pytest.raises(ValueError, match=expected):  # pydantic's ValidationError around our ConfigError
        _engine_config(checkpoint, dtype="float32", gdn_prefill_backend="flashinfer")


def test_the_config_hook_refuses_before_any_worker_starts(checkpoint: Path, tmp_path: Path) -> None:
    """The refusals run where vLLM builds its config (`vllm_config_hook.refuse_early`), the way
    stock's own config errors do, so `vllm serve` fails in seconds rather than after every worker
    has started: here a GDN key head that two ranks cannot split."""
    model = _edited_copy(checkpoint, tmp_path / "one_key_head", linear_num_key_heads=1, linear_num_value_heads=3)
    with pytest.raises(ValueError, match="linear_num_key_heads: 1 heads cannot be split over tensor_parallel_size=2"):
        _engine_config(model, dtype="float32", tensor_parallel_size=2)
    _engine_config(model, dtype="float32")  # one rank holds the head
