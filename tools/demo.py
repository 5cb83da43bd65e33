"""The main job on the embedded default: build a tiny checkpoint with the real Qwen3.6
tokenizer, serve it with stock vLLM and our plugins, and answer one chat request through
the `openai` client.

    .venv/bin/python tools/demo.py [--model-type qwen3|qwen4_exp_text|qwen3_8_flash_next_text]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openai import OpenAI  # noqa: E402

from qwen38_plugin.tiny.checkpoints import MODEL_TYPES, build_tiny_checkpoint  # noqa: E402
from tools.vllm_server import VllmServer  # noqa: E402

DEMO_DIR = ROOT / ".cache" / "demo"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="qwen4_exp_text")
    parser.add_argument("--prompt", default="Name three colours of the sea.")
    args = parser.parse_args()

    checkpoint = DEMO_DIR / f"tiny-{args.model_type}"
    if not checkpoint.exists():
        print(f"demo: building {checkpoint} (random weights, real Qwen3.6 tokenizer)", flush=True)
        build_tiny_checkpoint(checkpoint, args.model_type, seed=0)
    log = DEMO_DIR / f"server-{args.model_type}.log"
    print(f"demo: starting stock vLLM with the plugins (log: {log}) ...", flush=True)
    with VllmServer(checkpoint, ["--served-model-name", "tiny", "--max-model-len", "2048"], log_path=log) as server:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": args.prompt}],
            max_tokens=16,
            temperature=0.0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        choice = reply.choices[0]
        print(f"demo: request  -> {args.prompt!r}")
        print(
            f"demo: response <- {choice.message.content!r} (finish_reason={choice.finish_reason}, "
            f"{reply.usage.completion_tokens if reply.usage else '?'} tokens; random weights, so not words)"
        )
        registered = [line for line in server.log().splitlines() if " registered in process " in line]
        print(f"demo: plugin registrations seen in the server log: {len(registered)}")
    return 0 if choice.message.content else 1


if __name__ == "__main__":
    sys.exit(main())
