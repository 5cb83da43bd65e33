"""Weight memory of the portable Qwen4Exp per tensor-parallel rank: on the device and in host memory.

    python benchmarks/qwen38_plugin/footprint.py [--tp 1,2,4] [--dtype-bytes 2]

For the medium benchmark config and for Qwen3.8 Flash-Next's geometry (not published: the values
vLLM 0.32's kernel comments imply, ../shared/docs/stock-vllm-matrix.md, with transformers'
defaults where nothing says otherwise; the PLE table then holds about 45 G entries, the "roughly
90 GiB" of that document), with the PLE tables in host memory (``QWEN38_PLE_TABLE=host``: one
copy per node, shared by its ranks) and on the device (``=device``: every rank holds the tables).
Counted from the config as the model splits it (`vllm_model`, README "Tensor parallelism"),
weights only (no KV cache, no activations). Prints GiB.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "qwen38_plugin"))
sys.path.insert(0, str(ROOT / "src" / "qwen38_plugin"))

from bench_cpu import CONFIGS  # noqa: E402

# Inferred, see the module docstring; layer pattern and counts are transformers' defaults.
FLASH_NEXT: dict[str, Any] = {
    "vocab_size": 248_320,
    "hidden_size": 2560,
    "num_hidden_layers": 40,
    "layer_types": (["linear_attention"] * 3 + ["indexed_attention"]) * 10,
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 640,
    "hc_count": 4,
    "hc_lowrank": 320,
    "ple_layer_ids": [1],
    "ple_embed_dim": 2560,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
    "indexer_n_heads": 16,
    "indexer_head_dim": 128,
}


def ple_table_entries(config: dict[str, Any]) -> int:
    """Entries of all PLE tables: each head's prime-sized rows (as the model sizes them) padded to
    the divisor, times the per-head width."""
    from qwen38_plugin.ops import ple

    heads = (config["ngram_size"] - 1) * config["heads_per_ngram"]
    width = config["ple_embed_dim"] // heads
    total = 0
    for layer in range(len(config.get("ple_layer_ids") or [])):
        sizes = ple.ngram_head_sizes(
            config["ngram_size"], config["heads_per_ngram"], config["ngram_vocab_size_base"], layer
        )
        total += ple.table_rows(sizes, config["make_ngram_vocab_size_divisible_by"]) * width
    return total


def rank_params(config: dict[str, Any], tp: int) -> int:
    """Parameters one rank holds on the device, PLE tables excluded."""
    h, hc = config["hidden_size"], config["hc_count"]
    width = h * hc
    vocab = math.ceil(config["vocab_size"] / tp / 64) * 64  # vLLM pads each rank's share
    params = 2 * vocab * h  # embedding and lm_head rows
    mixer = width * config["hc_lowrank"] * 2 + width * (hc + 1)
    params += (2 * len(config["layer_types"]) + 1) * mixer
    e, inter, shared = config["num_experts"], config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    for kind in config["layer_types"]:
        if kind == "linear_attention":
            kd = config["linear_num_key_heads"] * config["linear_key_head_dim"]
            vd = config["linear_num_value_heads"] * config["linear_value_head_dim"]
            conv = 2 * kd + vd
            params += (h * (conv + vd) + 2 * h * config["linear_num_value_heads"] + vd * h + conv * 4) // tp
        else:
            d = config["head_dim"]
            kv = max(1, config["num_key_value_heads"] // tp) * d  # replicated below one head per rank
            params += (
                h * (2 * config["num_attention_heads"] * d // tp + 2 * kv) + config["num_attention_heads"] * d * h // tp
            )
            params += h * (config["indexer_n_heads"] + 1) * config["indexer_head_dim"]  # replicated
        params += (e * 3 * h * inter + 3 * h * shared) // tp + h * (e + 1)
    for _ in config.get("ple_layer_ids") or []:
        params += config["ple_embed_dim"] * (width + h) + 4 * width
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="2 for fp16/bf16 weights")
    args = parser.parse_args()
    from transformers import Qwen4ExpTextConfig

    from qwen38_plugin.tiny.checkpoints import tiny_config_dict

    medium = Qwen4ExpTextConfig(**tiny_config_dict("qwen4_exp_text", CONFIGS["medium"])).to_dict()
    gib = 2**30
    print("| model | TP | device per rank, PLE on host | host per node (PLE) | device per rank, PLE on device |")
    print("|---|---|---|---|---|")
    for name, config in (("medium", medium), ("Flash-Next (inferred)", FLASH_NEXT)):
        table = ple_table_entries(config) * args.dtype_bytes
        for tp in (int(t) for t in args.tp.split(",")):
            weights = rank_params(config, tp) * args.dtype_bytes
            print(f"| {name} | {tp} | {weights / gib:.3f} | {table / gib:.3f} | {(weights + table) / gib:.3f} |")


if __name__ == "__main__":
    main()
