"""Load checkpoints with stock vLLM's model loader in this process, as an engine's worker does at startup.

    python load_only.py LOAD_FORMAT [KEY=VALUE ...] MODEL [MODEL ...]

For each MODEL: build vLLM's config for it (``EngineArgs``, this repository's plugins registered as
vLLM registers them), then ``get_model_loader(load_config).load_model(...)``: the model is built and
its weights loaded and processed exactly as at engine startup, without the engine's processes, KV
cache or profiling run. ``KEY=VALUE`` arguments are further `EngineArgs` fields for every model
(strings, e.g. ``quantization=awq_sm70``). Prints one JSON line per model:
``{"model": ..., "loaded": true}`` or ``{"model": ..., "error": "<type>: <message>"}``.
"""

from __future__ import annotations

import json
import sys
import tempfile


def main() -> int:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    load_format, rest = sys.argv[1], sys.argv[2:]
    extra = dict(arg.split("=", 1) for arg in rest if "=" in arg)
    models = [arg for arg in rest if "=" not in arg]
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            args = EngineArgs(model=model, load_format=load_format, enforce_eager=True, max_model_len=256, **extra)
            vllm_config = args.create_engine_config()
            with set_current_vllm_config(vllm_config):
                if not model_parallel_is_initialized():
                    init_distributed_environment(1, 0, f"file://{tmp}/init", 0, backend="gloo")
                    initialize_model_parallel(1, 1)
                try:
                    loader = get_model_loader(vllm_config.load_config)
                    loader.load_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
                    print(json.dumps({"model": model, "loaded": True}), flush=True)
                except Exception as exc:  # reported, not raised: the caller checks the message
                    print(json.dumps({"model": model, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
