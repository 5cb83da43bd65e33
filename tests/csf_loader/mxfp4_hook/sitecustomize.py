"""Test-only startup hook for the MXFP4-CSF engine test (on PYTHONPATH of that engine only).

Every vLLM process imports it at interpreter start (engine core and TP workers are spawned
with the same environment). With CSF_TEST_DUMP_DIR set it:
* wraps ``csf_loader.register`` so that, once the plugin is registered, the ``csf`` loader
  writes every rank's decoder-layer parameters right after stock's weight loading, i.e. the tensors
  stock's quantization methods registered and filled, before their kernel-specific
  ``process_weights_after_loading``, to ``CSF_TEST_DUMP_DIR/rank<N>.safetensors``;
* on a CPU without AMX (CSF_TEST_FAKE_AMX=1), reports AMX tiles as supported, because
  stock's only CPU MXFP4 MoE kernel (``CPUExpertsMxfp4``) needs them and stock's MXFP4 MoE
  method otherwise refuses to be built ("No MXFP4 MoE backend supports the deployment
  configuration"), before any weight is loaded. The kernel itself cannot run there. The AMX path
  of stock's dense CPU linear layers (``check_cpu_sgl_kernel``, which reads the same flag) is then
  kept off: its weight packing op exists only in the AVX-512-BF16 build of vLLM's CPU kernels.
  Where that build is not the one loaded (a CPU without AVX-512-BF16), the MXFP4 MoE method's
  packing for the AMX kernel, which runs after the dump and only serves a forward this engine
  never runs, leaves the tensors as loaded.
"""

from __future__ import annotations

import os
from typing import Any

if os.environ.get("CSF_TEST_DUMP_DIR"):
    import torch

    FAKE_AMX = os.environ.get("CSF_TEST_FAKE_AMX") == "1" and not torch.cpu._is_amx_tile_supported()
    if FAKE_AMX:
        torch.cpu._is_amx_tile_supported = lambda: True

    import csf_loader

    _register = csf_loader.register

    def register() -> list[str]:
        registered = _register()
        if FAKE_AMX:
            from vllm.model_executor.layers import utils as layer_utils

            layer_utils.check_cpu_sgl_kernel = lambda n, k, dtype: False  # the real CPU has no AMX
            from vllm.model_executor.layers.fused_moe.experts import cpu_moe

            prepare = cpu_moe.prepare_mxfp4_moe_layer_for_cpu

            def prepare_or_keep(*tensors: torch.Tensor) -> Any:
                if hasattr(torch.ops._C, "convert_weight_packed"):
                    return prepare(*tensors)
                return tensors

            cpu_moe.prepare_mxfp4_moe_layer_for_cpu = prepare_or_keep
        from csf_loader import vllm_loader

        original = vllm_loader.CsfModelLoader.load_weights
        if getattr(original, "_csf_test_dump", False):
            return registered

        def load_weights(self: Any, model: torch.nn.Module, model_config: Any) -> None:
            original(self, model, model_config)
            from safetensors.torch import save_file
            from vllm.distributed import get_tensor_model_parallel_rank

            # Decoder-layer parameters only (the vocabulary-sized embeddings are plain bf16).
            tensors = {n: p.detach().cpu().contiguous().clone() for n, p in model.named_parameters() if ".layers." in n}
            path = os.path.join(os.environ["CSF_TEST_DUMP_DIR"], f"rank{get_tensor_model_parallel_rank()}.safetensors")
            save_file(tensors, path)

        load_weights._csf_test_dump = True  # type: ignore[attr-defined]
        vllm_loader.CsfModelLoader.load_weights = load_weights  # type: ignore[method-assign]
        return registered

    csf_loader.register = register
