"""Which implementation serves Qwen4ExpForCausalLM: stock vLLM's where it runs, ours elsewhere.

The rule is checked on real `VllmConfig` objects of the tiny checkpoint (built by vLLM's own
`EngineArgs`), on this CPU and, by naming the platform, as if on CUDA devices; the dispatching
class is checked against stock's class (the interfaces vLLM inspects) and against a real vLLM
engine on CPU (it logs its choice and serves our model's tokens, in fp16).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from qwen38_plugin import dispatch
from qwen38_plugin.dispatch import FORCE_ENV, DispatchError, Target, decide, target_of
from tests.engines import IN_PROCESS, run_engine_script

HERE = Path(__file__).resolve().parent
CUDA_90, CUDA_70, ROCM = ("cuda", (9, 0)), ("cuda", (7, 0)), ("rocm", None)
PORTABLE_CPU = "Qwen4ExpForCausalLM: portable (qwen38_plugin) implementation (CPU platform)"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@pytest.fixture(scope="module")
def configs(tiny_checkpoint: Callable[..., Path]) -> Iterator[dict[str, Any]]:
    """VllmConfig of the tiny qwen4_exp_text checkpoint per dtype, as `vllm serve` builds it."""
    from vllm.engine.arg_utils import EngineArgs

    from qwen38_plugin import register

    register()
    # output_gate_type set, as stock's GDN layer needs (the plain tiny checkpoint leaves it unset), and
    # a QSA block top-k stock's CUDA top-k kernel takes (2048 / 4 = 512; the tiny default is 16 / 4 = 4)
    model = tiny_checkpoint("qwen4_exp_text", overrides={"output_gate_type": "silu", "indexer_budget": 2048})
    unset = tiny_checkpoint("qwen4_exp_text")
    small_topk = tiny_checkpoint("qwen4_exp_text", overrides={"output_gate_type": "silu"})
    saved = os.environ.pop(FORCE_ENV, None)
    try:
        configs = {
            name: EngineArgs(model=str(model), dtype=name, enforce_eager=True, max_model_len=512).create_engine_config()
            for name in DTYPES
        }
        configs["bfloat16-gate-unset"] = EngineArgs(
            model=str(unset), dtype="bfloat16", enforce_eager=True, max_model_len=512
        ).create_engine_config()
        configs["bfloat16-topk-4"] = EngineArgs(
            model=str(small_topk), dtype="bfloat16", enforce_eager=True, max_model_len=512
        ).create_engine_config()
        yield configs
    finally:
        if saved is not None:
            os.environ[FORCE_ENV] = saved


@pytest.fixture
def stock_kernel_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stock's CUDA kernel packages (FlashInfer, the CUTLASS DSL) count as installed: the rule is
    checked here as if on a CUDA machine that has them (this CPU machine has neither)."""
    monkeypatch.setattr(dispatch, "STOCK_CUDA_MODULES", (("torch", "torch"),))


TOPK_4 = (
    "indexer_budget 16 / indexer_compress_ratio 4 is a QSA block top-k of 4, and stock's CUDA top-k kernel takes "
    "512, 1024, 2048 only"
)
GATE_UNSET = (
    "the config leaves output_gate_type unset (stock's GDN layer asserts on it; transformers and the portable "
    "model use hidden_act)"
)


@pytest.mark.usefixtures("stock_kernel_packages")
@pytest.mark.parametrize(
    ("platform", "dtype", "portable", "reason"),
    [
        (None, "bfloat16", True, "CPU platform"),  # this machine
        (None, "float16", True, "CPU platform"),
        (CUDA_90, "bfloat16", False, "cuda 9.0, bfloat16: stock's runs here"),
        (CUDA_90, "float16", True, "dtype float16 (stock's QSA attention requires bfloat16)"),
        (CUDA_90, "float32", True, "dtype float32 (stock's QSA attention requires bfloat16)"),
        (CUDA_70, "bfloat16", True, "CUDA capability 7.0 < 8.0"),
        (CUDA_70, "float16", True, "CUDA capability 7.0 < 8.0"),
        (ROCM, "bfloat16", False, "rocm, bfloat16: stock's runs here"),
        # seen on the H200: stock's engine failed at startup on such a checkpoint
        (CUDA_90, "bfloat16-gate-unset", True, f"{GATE_UNSET}; {TOPK_4}"),  # every reason, in one line
        (ROCM, "bfloat16-gate-unset", True, GATE_UNSET),
        # seen on an H100: stock's prefill top-k kernel refused a block top-k of 8
        (CUDA_90, "bfloat16-topk-4", True, TOPK_4),
        (ROCM, "bfloat16-topk-4", False, "rocm, bfloat16: stock's runs here"),  # another top-k kernel there
    ],
)
def test_rule_on_real_configs(configs: dict[str, Any], platform: Any, dtype: str, portable: bool, reason: str) -> None:
    target = target_of(configs[dtype], platform)
    assert target.dtype == DTYPES[dtype.split("-")[0]]
    assert decide(target, None) == dispatch.Choice(portable, reason)


def test_stock_kernel_packages_missing_picks_the_portable_model(configs: dict[str, Any]) -> None:
    """On this machine FlashInfer and the CUTLASS DSL are absent, as on the H200 the project borrows
    (where stock's engine then failed with "No module named 'flashinfer'"): bf16 on CUDA 9.0 goes
    to the portable model, and forcing stock's names the packages."""
    import importlib.util

    missing = [p for m, p in dispatch.STOCK_CUDA_MODULES if importlib.util.find_spec(m) is None]
    assert missing == ["flashinfer-python", "nvidia-cutlass-dsl"], "this test needs a machine without them"
    target = target_of(configs["bfloat16"], CUDA_90)
    reason = "stock's CUDA kernels need flashinfer-python and nvidia-cutlass-dsl, not installed"
    assert decide(target, None) == dispatch.Choice(True, reason)
    with pytest.raises(DispatchError, match=r"FORCE_PORTABLE=0 forbids .*need flashinfer-python and nvidia-cut"):
        decide(target, "0")
    # ROCm does not import them
    assert not decide(target_of(configs["bfloat16"], ROCM), None).portable


@pytest.mark.usefixtures("stock_kernel_packages")
def test_switch_forces_either_way_and_never_falls_back(configs: dict[str, Any]) -> None:
    bf16_h200 = target_of(configs["bfloat16"], CUDA_90)
    assert decide(bf16_h200, "1") == dispatch.Choice(True, "QWEN38_FORCE_PORTABLE=1")
    assert decide(bf16_h200, "0") == dispatch.Choice(False, "QWEN38_FORCE_PORTABLE=0")
    with pytest.raises(DispatchError, match=r"QWEN38_FORCE_PORTABLE=0 forbids .* cannot run here: CPU platform"):
        decide(target_of(configs["bfloat16"]), "0")
    with pytest.raises(DispatchError, match=r"cannot run here: dtype float16 \(stock's QSA attention requires bf"):
        decide(target_of(configs["float16"], CUDA_90), "0")
    with pytest.raises(DispatchError, match="QWEN38_FORCE_PORTABLE='true': use 1"):
        dispatch.read_force({FORCE_ENV: "true"})


def test_portable_choice_refuses_what_the_portable_model_lacks() -> None:
    fp16 = Target("cuda", (9, 0), torch.float16)
    # the portable model drafts with its MTP head (test_qwen38_spec_verify_engine.py) ...
    assert decide(dataclasses.replace(fp16, speculative_method="mtp", prefix_caching=True), None).portable
    cpu = Target("cpu", None, torch.float32, speculative_method="mtp")
    assert decide(cpu, None).portable
    # ... but not with prefix caching on CPU (vLLM's CPU runner cannot copy the states for it)
    with pytest.raises(DispatchError, match=r"--enable-prefix-caching together with --speculative-config on CPU .*"
                       r"pass --no-enable-prefix-caching"):  # fmt: skip
        decide(dataclasses.replace(cpu, prefix_caching=True), None)
    # ... for the portable multimodal model too (test_qwen38_mm_mtp_engine.py), with MTP only
    assert decide(dataclasses.replace(cpu, architecture=dispatch.MM_ARCHITECTURE), None).portable
    with pytest.raises(
        DispatchError, match=r"speculative method 'dflash' with the multimodal .*use --speculative-config .*mtp"
    ):
        decide(dataclasses.replace(cpu, speculative_method="dflash", architecture=dispatch.MM_ARCHITECTURE), None)
    # ... and verifies a DFlash drafter's blocks (tests/dflash2/test_dflash_qwen4exp_engine.py) ...
    assert decide(dataclasses.replace(cpu, speculative_method="dflash"), None).portable
    # ... without prefix caching (the QSA block keys would get no hits beside it) ...
    with pytest.raises(DispatchError, match=r"--enable-prefix-caching together with speculative method 'dflash' "
                       r".*pass --no-enable-prefix-caching"):  # fmt: skip
        decide(dataclasses.replace(cpu, speculative_method="dflash", prefix_caching=True), None)
    # ... on a GPU in vLLM's V2 model runner (its default there; lossless on the H200, drafts accepted) ...
    for gpu in (fp16, Target("cuda", (7, 0), torch.float16), Target("rocm", None, torch.float16)):
        assert decide(dataclasses.replace(gpu, speculative_method="dflash"), None).portable
        # ... but not in V1 there, where the H200 accepted none of its drafts
        refused = rf"speculative method 'dflash' in vLLM's V1 model runner on {gpu.platform} \(no draft was ever "
        with pytest.raises(DispatchError, match=refused + r".*unset VLLM_USE_V2_MODEL_RUNNER or set it to 1"):
            decide(dataclasses.replace(gpu, speculative_method="dflash", v2_model_runner=False), None)
    # other proposers are not proven through a real engine: refused at startup, naming the fix
    for method in ("ngram", "eagle3", "eagle", "draft_model", "suffix"):
        with pytest.raises(DispatchError, match=rf"speculative method '{method}' \(the portable model drafts with its "
                           r"MTP head or a DFlash drafter only\): use --speculative-config .*mtp.*dflash.* or drop "
                           r"--speculative-config"):  # fmt: skip
            decide(dataclasses.replace(fp16, speculative_method=method), None)
    with pytest.raises(DispatchError, match="pipeline_parallel_size=2: use --pipeline-parallel-size 1"):
        decide(dataclasses.replace(fp16, pipeline_parallel_size=2), None)
    # stock's keeps them
    bf16 = dataclasses.replace(fp16, dtype=torch.bfloat16, speculative_method="mtp", pipeline_parallel_size=2)
    assert not decide(bf16, None).portable


def test_dispatcher_reports_stock_interfaces_to_the_registry() -> None:
    """vLLM inspects the registered class before any config exists: it must see what stock's offers."""
    import importlib

    from vllm.model_executor.models.registry import _ModelInfo

    from qwen38_plugin.vllm_dispatch import Qwen4ExpForCausalLM

    stock = importlib.import_module("vllm.models.qwen4_exp").Qwen4ExpForCausalLM
    ours = dataclasses.asdict(_ModelInfo.from_model_cls(Qwen4ExpForCausalLM))
    theirs = dataclasses.asdict(_ModelInfo.from_model_cls(stock))
    differ = {k for k in ours if ours[k] != theirs[k]}
    # The portable model's prefix caching (a flag vLLM 0.32 does not read) is the only addition.
    assert differ == {"supports_mamba_prefix_caching"}, {k: (ours[k], theirs[k]) for k in differ}
    assert ours["is_hybrid"] and ours["has_inner_state"] and ours["supports_pp"] and ours["is_text_generation_model"]
    # and every capability the portable model declares (it may be the one built)
    from qwen38_plugin.vllm_model import PortableQwen4ExpForCausalLM

    portable = dataclasses.asdict(_ModelInfo.from_model_cls(PortableQwen4ExpForCausalLM))
    assert not [k for k, v in portable.items() if v is True and ours[k] is not True]
    # read from the class by vLLM's quantization setup, before the model is built
    assert Qwen4ExpForCausalLM.packed_modules_mapping is stock.packed_modules_mapping
    assert hasattr(Qwen4ExpForCausalLM, "get_mtp_target_hidden_states")


def test_dispatcher_builds_the_chosen_model_and_logs_why(
    configs: dict[str, Any], monkeypatch: pytest.MonkeyPatch, vllm_single_rank: None
) -> None:
    from vllm.model_executor.model_loader.utils import initialize_model

    from qwen38_plugin.vllm_dispatch import Qwen4ExpForCausalLM
    from qwen38_plugin.vllm_model import PortableQwen4ExpForCausalLM

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    dispatch.logger.addHandler(handler)
    dispatch._announced.clear()
    try:
        config = configs["float16"]
        model = initialize_model(config, model_class=Qwen4ExpForCausalLM)
        assert type(model) is PortableQwen4ExpForCausalLM
        initialize_model(configs["bfloat16"], model_class=Qwen4ExpForCausalLM)
    finally:
        dispatch.logger.removeHandler(handler)
    # one line per process and choice, however often vLLM builds or asks the class
    assert records == [
        "qwen38_plugin chose Qwen4ExpForCausalLM: portable (qwen38_plugin) implementation (CPU platform)"
    ]
    # what vLLM asks the class before building it
    shapes = PortableQwen4ExpForCausalLM.get_mamba_state_shape_from_config(config)
    assert Qwen4ExpForCausalLM.get_mamba_state_shape_from_config(config) == shapes
    assert Qwen4ExpForCausalLM.get_mamba_state_dtype_from_config(config) == (
        torch.float16, torch.float32, torch.float16, torch.int64,
    )  # fmt: skip
    (spec,) = Qwen4ExpForCausalLM.get_mamba_specs_from_config(config)
    assert spec.shapes == shapes
    # the state copy functions, asked on the class (inside the config) and on the built model:
    # one per state of the slot (the tiny model has PLE: 4)
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    gdn = {MambaAttentionBackendEnum.GDN_ATTN}
    with set_current_vllm_config(config):
        from_class = Qwen4ExpForCausalLM.get_mamba_state_copy_funcs(gdn)
    assert from_class == model.get_mamba_state_copy_funcs(gdn)
    assert len(from_class[MambaAttentionBackendEnum.GDN_ATTN]) == len(shapes) == 4
    monkeypatch.setenv(FORCE_ENV, "0")
    with pytest.raises(DispatchError, match="QWEN38_FORCE_PORTABLE=0 forbids"):
        initialize_model(config, model_class=Qwen4ExpForCausalLM)


def test_cpu_engine_serves_fp16_through_the_portable_model(tiny_checkpoint: Callable[..., Path]) -> None:
    """A real vLLM engine on CPU in fp16 logs the choice and serves transformers' greedy tokens."""
    from tests.qwen38_plugin.test_qwen38_vllm_engine import STEPS, reference_greedy

    model = tiny_checkpoint("qwen4_exp_text")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 248_000, (n,), generator=gen).tolist() for n in (2, 21)]
    env = {k: v for k, v in os.environ.items() if k != FORCE_ENV} | {"VLLM_CPU_KVCACHE_SPACE": "1", **IN_PROCESS}
    args = [str(model), "float16", str(STEPS), json.dumps(prompts), json.dumps({"max_num_seqs": 4})]
    cmd = [sys.executable, str(HERE / "qwen38_engine_greedy.py"), *args]
    proc = run_engine_script(cmd, env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    chose = [line for line in log.splitlines() if "qwen38_plugin chose" in line]
    assert chose, log[-6000:]
    assert all(
        line.endswith("Qwen4ExpForCausalLM: portable (qwen38_plugin) implementation (CPU platform)") for line in chose
    )
    served = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"tokens"')][-1])["tokens"]
    assert served == reference_greedy(model, prompts, torch.float16)


@pytest.mark.parametrize("v2_runner", ["0", "1"])
def test_v1_runner_on_cuda_gets_piecewise_graphs_only(
    configs: dict[str, Any], monkeypatch: pytest.MonkeyPatch, v2_runner: str
) -> None:
    """In vLLM's V1 model runner on CUDA the portable model's full decode graphs go (a one-token
    prompt would replay them over a stale state slot); in V2, and off CUDA, nothing changes."""
    from vllm import envs
    from vllm.config import CUDAGraphMode

    from qwen38_plugin.vllm_config_hook import keep_full_graphs_out_of_the_v1_runner

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2_runner)
    envs.disable_envs_cache()  # read the variable now, not a value cached before
    vllm_config = configs["float16"]
    compilation = vllm_config.compilation_config
    saved = compilation.cudagraph_mode
    try:
        for mode in (None, CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY):
            compilation.cudagraph_mode = mode
            assert not keep_full_graphs_out_of_the_v1_runner(vllm_config)  # this CPU machine: untouched
            assert compilation.cudagraph_mode == mode
            changed = keep_full_graphs_out_of_the_v1_runner(vllm_config, on_cuda=True)
            assert changed == (v2_runner == "0")
            assert compilation.cudagraph_mode == (CUDAGraphMode.PIECEWISE if changed else mode)
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
        assert not keep_full_graphs_out_of_the_v1_runner(vllm_config, on_cuda=True)
    finally:
        compilation.cudagraph_mode = saved
