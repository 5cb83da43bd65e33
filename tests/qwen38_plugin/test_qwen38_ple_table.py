"""The PLE table keeps the checkpoint's dtype (row K15 of the stock matrix), whatever the model's.

`vllm_ple.NGramTable` is built for the tiny Qwen4Exp served in fp32 and fed shards directly (as
`vllm_model.load_weights` feeds them), in both placements (host shared memory, device):
bf16 shards stay bf16 (rows converted at lookup), an FP8 table is dequantized with its global
scale as stock's FP8 PLE method does, and every inconsistency fails naming the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

PREFIX = "model.layers.0.ple.ple_embedding"


@pytest.fixture(scope="module")
def vllm_config(tiny_checkpoint: Callable[..., Path], vllm_single_rank: None) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    model_dir = tiny_checkpoint("qwen4_exp_text", dtype="float32")
    args = EngineArgs(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256)
    return args.create_engine_config()


@pytest.fixture(params=["host", "device"])
def new_table(request: pytest.FixtureRequest, vllm_config: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`new_table(**config_overrides)`: an NGramTable of PLE layer 0 in the parametrized placement."""
    from vllm.config import set_current_vllm_config

    from qwen38_plugin.vllm_ple import NGramTable

    monkeypatch.setenv("QWEN38_PLE_TABLE", request.param)
    built: list[Any] = []

    def build(**overrides: Any) -> Any:
        config = vllm_config.model_config.hf_text_config
        for key, value in overrides.items():
            monkeypatch.setattr(config, key, value, raising=False)
        with set_current_vllm_config(vllm_config):
            table = NGramTable(vllm_config, config, 0, PREFIX)
        built.append(table)
        return table

    yield build
    for table in built:  # a host table whose loading failed keeps its shared-memory name
        if table._shared is not None:
            table._shared.unlink()


def shards(table: Any, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = (table.rows + 1) // 2
    return [(torch.randn(per, table.dim, generator=g) * 0.5).to(dtype) for _ in range(2)]


def test_a_bf16_table_stays_bf16_in_an_fp32_model(new_table: Any) -> None:
    table = new_table()
    parts = shards(table, torch.bfloat16)
    for i, part in enumerate(parts):
        table.load_shard(i, part)
    host_bytes = table.finish_loading()
    assert table.dtype == torch.bfloat16 and table.compute_dtype == torch.float32
    assert host_bytes == (table.rows * table.dim * 2 if table.placement == "host" else 0)
    rows = torch.tensor([[0, 5], [table.rows - 1, len(parts[0])]])
    whole = torch.cat(parts)
    found = table.lookup(rows)
    assert found.dtype == torch.bfloat16 and torch.equal(found, whole[rows])


def test_an_fp8_table_is_dequantized_with_its_global_scale(new_table: Any) -> None:
    table = new_table()
    parts = shards(table, torch.float8_e4m3fn, seed=1)
    for i, part in enumerate(parts):
        table.load_shard(i, part)
    table.load_scale(torch.tensor([0.125]))
    table.finish_loading()
    rows = torch.tensor([3, 77, table.rows - 1])
    found = table.lookup(rows)
    assert found.dtype == torch.float32
    assert torch.equal(found, torch.cat(parts)[rows].to(torch.float32) * 0.125)


def test_inconsistent_tables_fail_naming_the_tensor(new_table: Any) -> None:
    name = f"{PREFIX}.ngram_embedding"
    table = new_table()
    for i, part in enumerate(shards(table, torch.float8_e4m3fn)):
        table.load_shard(i, part)
    no_scale = rf"{name}: the table is stored as float8_e4m3fn but .* no {name}.weight_scale"
    with pytest.raises(ValueError, match=no_scale):
        table.finish_loading()

    table = new_table()
    first, second = shards(table, torch.bfloat16)
    table.load_shard(0, first)
    with pytest.raises(ValueError, match=rf"{name}.shard_1.weight: stored as torch.float16, the table's other"):
        table.load_shard(1, second.to(torch.float16))

    table = new_table()
    with pytest.raises(ValueError, match=rf"{name}.shard_0.weight: a PLE table stored as torch.int8 is not supported"):
        table.load_shard(0, torch.zeros(8, table.dim, dtype=torch.int8))

    table = new_table()
    for i, part in enumerate(shards(table, torch.bfloat16)):
        table.load_shard(i, part)
    table.load_scale(torch.tensor(2.0))
    with pytest.raises(ValueError, match=rf"{name}.weight_scale: unexpected, the table is stored as torch.bfloat16"):
        table.finish_loading()

    table = new_table(ple_embedding_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match=r"config ple_embedding_dtype is 'float8_e4m3fn' but .* as bfloat16"):
        table.load_shard(0, shards(table, torch.bfloat16)[0])

    with pytest.raises(ValueError, match=rf"Qwen4Exp checkpoint has no shards of the PLE table {name}"):
        new_table().finish_loading()
