"""`qwen38-tiny-checkpoint`: write a tiny random checkpoint with the real Qwen3.6 tokenizer."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from qwen38_plugin.tiny.checkpoints import MODEL_TYPES, TinyCheckpointError, build_tiny_checkpoint


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set expects FIELD=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string such as hidden_act=silu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qwen38-tiny-checkpoint", description=__doc__)
    parser.add_argument("out_dir", help="directory to create (must not exist unless --overwrite)")
    parser.add_argument("--model-type", choices=MODEL_TYPES, default="qwen4_exp_text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", help="float32, float16 or bfloat16 (default)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=_parse_override,
        default=[],
        metavar="FIELD=VALUE",
        help="override a config field; VALUE is JSON (e.g. --set hc_count=2 --set ple_layer_ids=[])",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    args = parser.parse_args(argv)
    try:
        path = build_tiny_checkpoint(
            args.out_dir,
            args.model_type,
            seed=args.seed,
            overrides=dict(args.overrides),
            dtype=args.dtype,
            overwrite=args.overwrite,
        )
    except TinyCheckpointError as error:
        print(f"qwen38-tiny-checkpoint: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
