"""CSF (compressed scale format) FP4 checkpoints for stock vLLM.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in the API
server, the engine core and every worker process, so it is idempotent, cheap and
never touches a GPU.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered: list[str] | None = None


def register() -> list[str]:
    """Register this plugin with vLLM once per process; return what it registered."""
    global _registered
    if _registered is None:
        from csf_loader._registration import register_with_vllm

        _registered = register_with_vllm()
    return _registered
