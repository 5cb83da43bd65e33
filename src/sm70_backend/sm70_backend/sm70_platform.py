"""vLLM's CUDA platform for compute capability 7.x (V100), with FLASH_ATTN_V100 and the SM70 quirks.

Activated by the ``vllm.platform_plugins`` entry point (`sm70_backend.platform`), so vLLM's own
files stay untouched. Only two class methods differ from stock's `NvmlCudaPlatform`:
- `get_attn_backend_cls`: without ``--attention-backend``, a layer FLASH_ATTN_V100 can serve gets it
  (one log line per process); a layer it cannot serve (e.g. MLA, an unsupported head size) goes
  through stock's selection, with the reasons logged. An explicit choice is stock's path
  (FLASH_ATTN_V100 explicitly chosen for an unsupported layer fails at startup, naming the
  supported sets).
- `check_and_update_config`: stock's, then `sm70_config.apply_quirks` (bf16 -> fp16, the fp16
  range scan, the multimodal default), and stock's default GPU worker replaced by
  `worker.Sm70Worker` (stock's, refusing weight reloads of SM70 AWQ models before any change).
It adds one: `owns_multimodal_default(vllm_config)`, true where that multimodal default applies,
so a model's own default limits (qwen38_plugin's for Qwen4Exp, set in the architecture's config
hook, which vLLM runs before the platform's) leave the limits to it.
"""

from __future__ import annotations

from typing import Any

from vllm.platforms.cuda import NvmlCudaPlatform

from sm70_backend.sm70_config import apply_quirks, auto_backend, mm_default_applies, use_sm70_worker


class Sm70CudaPlatform(NvmlCudaPlatform):
    @classmethod
    def get_attn_backend_cls(
        cls, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None
    ) -> str:
        if selected_backend is None:
            path = auto_backend(cls.get_device_capability(), attn_selector_config)
            if path is not None:
                return path
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        super().check_and_update_config(vllm_config)
        capability = cls.get_device_capability()
        if capability is not None:
            apply_quirks(vllm_config, (capability.major, capability.minor))
        use_sm70_worker(vllm_config)

    @classmethod
    def owns_multimodal_default(cls, vllm_config: Any) -> bool:
        """Whether `check_and_update_config` sets the SM70 multimodal limits (1 image, no video)."""
        capability = cls.get_device_capability()
        return capability is not None and capability.major == 7 and mm_default_applies(vllm_config)
