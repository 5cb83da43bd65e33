"""The SM70 AWQ quantization method inside vLLM, on CPU: registration, which checkpoints it claims
where, its layers on vLLM's own weight loaders, startup refusals naming the supported set, and the
refusal of weight reloads before any tensor changes (R25 / R55).

Compute capability 7.x is simulated only through the SM70 platform class the plugin activates on
a V100 (`Sm70CudaPlatform`, its ``get_device_capability`` patched, installed as vLLM's current
platform in a subprocess), as test_backend_registration.py does for the attention backend.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import sm70_backend
from sm70_backend.kernels import awq as ops
from sm70_backend.kernels import awq_reference as ref
from tests.conftest import CACHE, build_cached_checkpoint
from tests.sm70_backend.awq_checkpoint import build_awq_pair, quantization_config


@pytest.fixture(scope="module")
def registered() -> list[str]:
    return sm70_backend.register()


@pytest.fixture(scope="module")
def awq_pair() -> tuple[Path, Path]:
    return build_awq_pair(build_cached_checkpoint("qwen3", dtype="float16"), CACHE / "awq_sm70" / "qwen3-g32")


@pytest.fixture(scope="module")
def vllm_context(registered: list[str]) -> Iterator[None]:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    with set_current_vllm_config(VllmConfig()):
        # One rank's state per process: an earlier module of the session may have made it already.
        if not model_parallel_is_initialized():
            init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
            initialize_model_parallel(1, 1)
        yield


def test_registered_under_its_own_name_and_stocks_awq_untouched(registered: list[str]) -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig

    from sm70_backend.awq_config import Sm70AwqConfig

    assert "quantization 'awq_sm70'" in registered
    assert "awq_sm70" in QUANTIZATION_METHODS
    assert get_quantization_config("awq_sm70") is Sm70AwqConfig
    assert get_quantization_config("awq") is AutoAWQConfig and get_quantization_config("auto_awq") is AutoAWQConfig


SELECTION_PROBE = """
import json, sys, types
sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
import sm70_backend
sm70_backend.register()  # on the CPU platform: vLLM's quantization modules import here
import vllm.platforms as platforms
from vllm.config import LoadConfig, ModelConfig, VllmConfig
from vllm.platforms.interface import DeviceCapability
from sm70_backend.sm70_platform import Sm70CudaPlatform
out = {}
for cap in [(7, 0), (7, 5), (8, 0), (9, 0)]:
    Sm70CudaPlatform.get_device_capability = classmethod(lambda cls, device_id=0, c=cap: DeviceCapability(*c))
    platforms._current_platform = Sm70CudaPlatform()  # what vLLM runs on a V100 with the plugin
    for user in [None, "awq", "awq_sm70"]:
        try:
            mc = ModelConfig(model=sys.argv[1], dtype="float16", quantization=user)
            qc = VllmConfig._get_quantization_config(mc, LoadConfig())
            out[f"{cap} {user}"] = [mc.quantization, type(qc).__name__]
        except Exception as e:
            out[f"{cap} {user}"] = [f"{type(e).__name__}: {e}"]
print(json.dumps(out))
"""


def test_claims_awq_checkpoints_on_compute_capability_7_only(awq_pair: tuple[Path, Path]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SELECTION_PROBE, str(awq_pair[0])], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    for cap in ("(7, 0)", "(7, 5)"):
        for user in ("None", "awq", "awq_sm70"):
            assert out[f"{cap} {user}"] == ["awq_sm70", "Sm70AwqConfig"], (cap, user, out)
    for cap in ("(8, 0)", "(9, 0)"):  # stock's AWQ path, exactly as without the plugin
        assert out[f"{cap} None"][0] == out[f"{cap} awq"][0] == "auto_awq", out
        assert out[f"{cap} awq_sm70"] == ["awq_sm70", "Sm70AwqConfig"]  # asked for by name


def test_on_cpu_stocks_awq_unless_asked_for_by_name(registered: list[str], awq_pair: tuple[Path, Path]) -> None:
    from vllm.config import LoadConfig, ModelConfig, VllmConfig

    assert ModelConfig(model=str(awq_pair[0]), dtype="float16").quantization == "awq"  # stock's CPU AWQ
    mc = ModelConfig(model=str(awq_pair[0]), dtype="float16", quantization="awq_sm70")
    qc = VllmConfig._get_quantization_config(mc, LoadConfig())
    assert mc.quantization == "awq_sm70" and (qc.group_size, qc.weight_bits, qc.zero_point) == (32, 4, True)
    # bf16 (or fp32) activations: vLLM's own startup check names the supported set.
    bf16 = ModelConfig(model=str(awq_pair[0]), dtype="bfloat16", quantization="awq_sm70")
    with pytest.raises(ValueError, match=r"bfloat16 is not supported for quantization method awq_sm70.*float16"):
        VllmConfig._get_quantization_config(bf16, LoadConfig())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"group_size": 96}, r"group size 96 is not supported; supported: group sizes \(32, 64, 128\)"),
        ({"group_size": -1}, r"group size -1 is not supported; supported: group sizes \(32, 64, 128\)"),
        ({"bits": 8}, r"8-bit weights are not supported; supported: bits \(4,\)"),
        ({"bits": 3}, r"3-bit weights are not supported; supported: bits \(4,\)"),
        ({"zero_point": False}, r"zero_point false .* supported: zero_point true"),
    ],
)
def test_bad_quantization_configs_fail_at_startup_naming_the_set(
    registered: list[str], awq_pair: tuple[Path, Path], tmp_path: Path, change: dict[str, object], message: str
) -> None:
    from vllm.config import LoadConfig, ModelConfig, VllmConfig

    from sm70_backend.awq_config import Sm70AwqConfig

    with pytest.raises(ValueError, match=message):
        Sm70AwqConfig.from_config({**quantization_config(32), **change})
    # The same through vLLM's startup path, from a checkpoint's config.json.
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((awq_pair[0] / "config.json").read_text())
    config["quantization_config"] = {**quantization_config(32), **change}
    (bad / "config.json").write_text(json.dumps(config))
    mc = ModelConfig(model=str(bad), tokenizer=str(awq_pair[0]), dtype="float16", quantization="awq_sm70")
    with pytest.raises(ValueError, match=message):
        VllmConfig._get_quantization_config(mc, LoadConfig())


def test_derived_unconverted_layers_leave_out_modules_holding_quantized_layers(registered: list[str]) -> None:
    """Without ``modules_to_not_convert`` the floating-point layers are derived from the
    checkpoint; a Gated DeltaNet module's own ``A_log`` must not make it one: layers match by
    substring, so its quantized projections would be built unquantized and their qweight unloadable
    (the AWQ Qwen4Exp of test_qwen38_quantization.py loads through this)."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    from sm70_backend.awq_config import floating_point_layers

    gdn = "model.layers.0.linear_attn"
    metadata = {
        f"{gdn}.A_log": {"dtype": "F32"},
        f"{gdn}.in_proj_qkv.qweight": {"dtype": "I32"},
        f"{gdn}.in_proj_qkv.scales": {"dtype": "F16"},
        f"{gdn}.in_proj_b.weight": {"dtype": "F16"},
        "model.layers.0.mlp.gate.weight": {"dtype": "BF16"},
    }
    unconverted = floating_point_layers(metadata)
    assert unconverted == [f"{gdn}.in_proj_b", "model.layers.0.mlp.gate"]
    assert not is_layer_skipped(f"{gdn}.in_proj_qkv", unconverted, match_mode="substring")
    assert is_layer_skipped("model.layers.0.mlp.gate", unconverted, match_mode="substring")


def test_shapes_and_dtypes_the_kernels_cannot_run_fail_when_the_layer_is_built(vllm_context: None) -> None:
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from sm70_backend.awq_config import Sm70AwqConfig

    cfg = Sm70AwqConfig(4, 64, True)
    with pytest.raises(ValueError, match=r"input size 96 per rank, not a multiple of the group size 64"):
        ReplicatedLinear(96, 64, bias=False, quant_config=cfg, prefix="x.proj", params_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"output size 36 per rank, not a multiple of 8"):
        ReplicatedLinear(128, 36, bias=False, quant_config=cfg, prefix="x.proj", params_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"layer x.proj would run in torch.bfloat16; supported: torch.float16"):
        ReplicatedLinear(128, 64, bias=False, quant_config=cfg, prefix="x.proj", params_dtype=torch.bfloat16)


def make_merged_layer(group_size: int = 32):  # type: ignore[no-untyped-def]
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    from sm70_backend.awq_config import Sm70AwqConfig

    layer = MergedColumnParallelLinear(
        128, [64, 40], bias=False, quant_config=Sm70AwqConfig(4, group_size, True), prefix="mlp.gate_up_proj",
        params_dtype=torch.float16,
    )  # fmt: skip
    g = torch.Generator().manual_seed(group_size)
    packed = [ref.quantize_awq((torch.randn(128, n, generator=g) * 0.05).half(), group_size) for n in (64, 40)]
    for shard, (qweight, qzeros, scales) in enumerate(packed):
        layer.qweight.weight_loader(layer.qweight, qweight, shard)
        layer.qzeros.weight_loader(layer.qzeros, qzeros, shard)
        layer.scales.weight_loader(layer.scales, scales, shard)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, packed


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_linear_layer_loads_awq_shards_and_equals_the_reference(vllm_context: None, group_size: int) -> None:
    from sm70_backend.awq_config import Sm70AwqLinearMethod

    layer, packed = make_merged_layer(group_size)
    assert isinstance(layer.quant_method, Sm70AwqLinearMethod)
    assert layer.qweight.shape == (128, 13) and layer.scales.shape == (128 // group_size, 104)
    x = torch.randn(3, 5, 128).half()
    y, _ = layer(x)
    want = torch.cat([ref.awq_matmul(x.reshape(15, 128), *p) for p in packed], -1).reshape(3, 5, 104)
    assert torch.equal(y, want)  # on CPU the method runs the reference itself


def test_moe_method_layout_and_apply(registered: list[str]) -> None:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from sm70_backend.awq_config import Sm70AwqConfig, Sm70AwqMoEMethod

    moe = SimpleNamespace(activation=MoEActivation.SILU, has_bias=False, w13_num_shards=2)
    method = Sm70AwqMoEMethod(Sm70AwqConfig(4, 32, True), moe, "mlp.experts")
    layer = torch.nn.Module()
    method.create_weights(layer, 3, 64, 32, torch.float16, weight_loader=lambda *a: None)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {
        "w13_qweight": (3, 64, 8), "w2_qweight": (3, 32, 8), "w13_scales": (3, 2, 64), "w2_scales": (3, 1, 64),
        "w13_qzeros": (3, 2, 8), "w2_qzeros": (3, 1, 8),
    }  # fmt: skip
    assert layer.w13_qweight.is_transposed and layer.w13_qweight.quant_method == "group"  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(1)
    w13 = [ref.quantize_awq((torch.randn(64, 64, generator=g) * 0.05).half(), 32) for _ in range(3)]
    w2 = [ref.quantize_awq((torch.randn(32, 64, generator=g) * 0.05).half(), 32) for _ in range(3)]
    for i, name in enumerate(("qweight", "qzeros", "scales")):
        getattr(layer, f"w13_{name}").data.copy_(torch.stack([w[i] for w in w13]))
        getattr(layer, f"w2_{name}").data.copy_(torch.stack([w[i] for w in w2]))
    method.process_weights_after_loading(layer)
    x = torch.randn(4, 64, generator=g).half()
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]])
    weights = torch.rand(4, 2, generator=g)
    got = method.apply(layer, x, weights, ids, None, None)
    stack = lambda ws: tuple(torch.stack([w[i] for w in ws]) for i in range(3))  # noqa: E731
    assert torch.equal(got, ref.moe_reference(x, stack(w13), stack(w2), weights, ids))
    with pytest.raises(ValueError, match=r"activation .*GELU.*; supported: silu"):
        Sm70AwqMoEMethod(Sm70AwqConfig(4, 32, True), SimpleNamespace(activation=MoEActivation.GELU), "e")
    with pytest.raises(
        ValueError, match=r"experts e w2 has input size 48 per rank, not a multiple of the group size 32"
    ):
        Sm70AwqMoEMethod(Sm70AwqConfig(4, 32, True), moe, "e").create_weights(
            torch.nn.Module(), 2, 64, 48, torch.float16, weight_loader=lambda *a: None
        )


def test_second_weight_processing_of_a_layer_fails_loudly(vllm_context: None) -> None:
    from sm70_backend.awq_config import Sm70AwqReloadError

    layer, _ = make_merged_layer()
    with pytest.raises(Sm70AwqReloadError, match=r"layer mlp.gate_up_proj was already loaded; reloading AWQ"):
        layer.quant_method.process_weights_after_loading(layer)


WORKER_PROBE = """
import json, sys, types
sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
import torch, sm70_backend
sm70_backend.register()
from types import SimpleNamespace
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.linear import ReplicatedLinear
from sm70_backend.awq_config import Sm70AwqConfig, Sm70AwqReloadError
from sm70_backend.sm70_config import use_sm70_worker
from sm70_backend.worker import Sm70Worker
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(1, 0, "file://" + sys.argv[1], 0, "gloo")
    initialize_model_parallel(1, 1)
    model = torch.nn.Sequential(
        torch.nn.Embedding(16, 64).half(),
        ReplicatedLinear(64, 64, bias=False, quant_config=Sm70AwqConfig(4, 32, True), prefix="1",
                         params_dtype=torch.float16),
    )
for p in model.parameters():
    p.data.copy_(torch.randint(0, 100, p.shape).to(p.dtype))
before = {n: p.detach().clone() for n, p in model.named_parameters()}
calls = []
worker = Sm70Worker.__new__(Sm70Worker)
worker.model_runner = SimpleNamespace(get_model=lambda: model, reload_weights=lambda *a, **k: calls.append("reload"))
out = {}
for name, call in [("reload_weights", lambda: worker.reload_weights(weights_path="/elsewhere")),
                   ("start_weight_update", lambda: worker.start_weight_update()),
                   ("update_weights", lambda: worker.update_weights({}))]:
    try:
        call()
        out[name] = "no error"
    except Sm70AwqReloadError as error:
        out[name] = str(error)
out["unchanged"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())
out["meta"] = any(p.is_meta for p in model.parameters())
out["calls"] = calls
plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
worker.model_runner = SimpleNamespace(get_model=lambda: plain, reload_weights=lambda *a, **k: calls.append("reload"))
worker.vllm_config = VllmConfig()
worker.reload_weights()
out["plain_calls"] = calls
cfg = SimpleNamespace(parallel_config=SimpleNamespace(worker_cls="vllm.v1.worker.gpu_worker.Worker"))
use_sm70_worker(cfg)
mine = SimpleNamespace(parallel_config=SimpleNamespace(worker_cls="my.Worker"))
use_sm70_worker(mine)
out["worker_cls"] = [cfg.parallel_config.worker_cls, mine.parallel_config.worker_cls]
print(json.dumps(out))
"""


def test_weight_reload_of_an_awq_model_is_refused_before_any_tensor_changes(tmp_path: Path) -> None:
    """The SM70 platform's worker (`Sm70Worker`) refuses reload_weights and weight transfer up front."""
    result = subprocess.run(
        [sys.executable, "-c", WORKER_PROBE, str(tmp_path / "dist")], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    for name in ("reload_weights", "start_weight_update", "update_weights"):
        assert "is not supported for AWQ layers on SM70 (first: 1); nothing was changed" in out[name], out
    assert out["unchanged"] is True and out["meta"] is False
    assert out["plain_calls"] == ["reload"]  # a model without SM70 AWQ layers reloads as stock's worker does
    assert out["worker_cls"] == ["sm70_backend.worker.Sm70Worker", "my.Worker"]


def test_startup_checks_of_the_ops(registered: list[str]) -> None:
    ops.check_config(4, 128, True, torch.float16)
    with pytest.raises(ValueError, match=r"activation dtype torch.float32 is not supported; supported: torch.float16"):
        ops.check_config(4, 128, True, torch.float32)
    assert ops.choose_splits(4096, 4096, 128, 80) == 10  # 16 CTAs of 256 columns: 10 splits make 160
    assert ops.choose_splits(65536, 4096, 128, 80) == 1
    assert ops.choose_splits(256, 64, 32, 80) == 2  # never more splits than groups
