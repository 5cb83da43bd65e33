"""dflash2-view: the seed's draft view (linked weights, config.json with the two settings), atomically."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dflash2.tiny import build_tiny_drafter
from dflash2.view import DEFAULT_MAX_POSITION_EMBEDDINGS, ViewError, main, make_view
from tests.test_packaging import make_venv, vllm_without_our_plugins  # noqa: F401  (a fixture)


@pytest.fixture
def drafter(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> Path:
    src = build_tiny_drafter(tmp_path / "models" / "drafter", tiny_checkpoint("qwen4_exp_text", dtype="float32"))
    (src / "mask_embedding.pt").write_bytes(b"not read here")
    (src / ".cache").mkdir()  # what `hf download --local-dir` leaves
    config = json.loads((src / "config.json").read_text())
    config["max_position_embeddings"] = 2048  # the drafter's trained window
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_the_view_links_the_weights_and_adds_the_two_settings(drafter: Path, tmp_path: Path, capsys: Any) -> None:
    dst = tmp_path / "views" / "dflash2-512k"
    assert main([str(drafter), str(dst)]) == 0
    assert "links mask_embedding.pt, model.safetensors" in capsys.readouterr().out
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "mask_embedding.pt", "model.safetensors"]
    for name in ("model.safetensors", "mask_embedding.pt"):
        assert (dst / name).is_symlink() and os.readlink(dst / name) == str(drafter / name)  # absolute, as the seed
    view = json.loads((dst / "config.json").read_text())
    source = json.loads((drafter / "config.json").read_text())
    assert view["dflash_config"]["target_feature_reduction"] == "hc_mean"
    assert view["max_position_embeddings"] == DEFAULT_MAX_POSITION_EMBEDDINGS == 524288
    # nothing else changes (the seed's script: json.load, set two keys, json.dump with indent=2)
    source["dflash_config"]["target_feature_reduction"] = "hc_mean"
    source["max_position_embeddings"] = 524288
    assert view == source
    assert (dst / "config.json").read_text() == json.dumps(source, indent=2) + "\n"
    assert [p.name for p in dst.parent.iterdir()] == ["dflash2-512k"]  # no staging left behind


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (lambda src, dst: dst.mkdir(), [], r"already exists; pass --overwrite to replace it"),
        (lambda src, dst: (src / "config.json").unlink(), [], r"config.json: not found"),
        (lambda src, dst: (src / "config.json").write_text("{"), [], r"config.json: not readable JSON"),
        (lambda src, dst: (src / "config.json").write_text("{}"), [], r"no dflash_config object"),
        (lambda src, dst: (src / "model.safetensors").unlink(), [], r"no weights \(\*.safetensors"),
        (
            lambda src, dst: (src / "config.json").write_text(
                json.dumps({"dflash_config": {"target_feature_reduction": "stream0"}})
            ),
            [],
            r"is already 'stream0'; the drafter was trained on another reduction",
        ),
        (lambda src, dst: None, ["--max-position-embeddings", "0"], r"must be positive, got 0"),
    ],
)
def test_bad_input_is_refused_and_leaves_nothing(
    drafter: Path, tmp_path: Path, capsys: Any, setup: Callable[[Path, Path], Any], args: list[str], message: str
) -> None:
    dst = tmp_path / "views" / "v"
    dst.parent.mkdir()
    setup(drafter, dst)
    before = sorted(p.name for p in dst.parent.iterdir())
    assert main([str(drafter), str(dst), *args]) == 2
    with pytest.raises(ViewError, match=message):
        make_view(drafter, dst, **_kwargs(args))
    assert capsys.readouterr().err.startswith("dflash2-view: ")
    assert sorted(p.name for p in dst.parent.iterdir()) == before


def _kwargs(args: list[str]) -> dict[str, Any]:
    return {"max_position_embeddings": int(args[1])} if args else {}


def test_missing_source_and_a_view_inside_the_source_are_refused(drafter: Path, tmp_path: Path) -> None:
    with pytest.raises(ViewError, match="not a directory"):
        make_view(tmp_path / "nowhere", tmp_path / "v")
    with pytest.raises(ViewError, match="inside the drafter directory"):
        make_view(drafter, drafter / "view")


def test_overwrite_replaces_and_a_failure_leaves_the_old_view(
    drafter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "v"
    make_view(drafter, dst, max_position_embeddings=4096)
    make_view(drafter, dst, max_position_embeddings=8192, overwrite=True)
    assert json.loads((dst / "config.json").read_text())["max_position_embeddings"] == 8192

    def fail(self: Path, target: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(Path, "symlink_to", fail)
    with pytest.raises(OSError, match="disk full"):
        make_view(drafter, dst, max_position_embeddings=16384, overwrite=True)
    assert json.loads((dst / "config.json").read_text())["max_position_embeddings"] == 8192
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".v")) == []


def draft_context(target: Path, draft: Path) -> int:
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    import dflash2

    dflash2.register()
    spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 4}
    args = EngineArgs(model=str(target), dtype="float32", max_model_len=4096, speculative_config=spec)
    config = args.create_speculative_config(args.create_model_config(), ParallelConfig())
    assert config is not None
    return int(config.draft_model_config.max_model_len)


def test_the_served_context_is_the_views(drafter: Path, tmp_path: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    target = tiny_checkpoint("qwen4_exp_text", dtype="float32")  # max_position_embeddings 4096
    assert draft_context(target, make_view(drafter, tmp_path / "a").path) == 4096  # 524288, capped by the target
    assert draft_context(target, make_view(drafter, tmp_path / "b", max_position_embeddings=1024).path) == 1024


def test_the_console_script_is_installed(
    tmp_path: Path,
    vllm_without_our_plugins: Path,  # noqa: F811
    drafter: Path,
) -> None:
    venv = make_venv(tmp_path, vllm_without_our_plugins)
    # a copy: pip builds in the source tree, and its build files must not land in src/
    source = shutil.copytree(
        Path(__file__).resolve().parents[2] / "src" / "dflash2",
        tmp_path / "dflash2-source",
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    pip = [venv / "bin" / "python", "-m", "pip", "install", "--no-build-isolation", "--no-index", str(source)]
    install = subprocess.run(pip, capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    run = subprocess.run(
        [venv / "bin" / "dflash2-view", str(drafter), str(tmp_path / "v")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert (
        json.loads((tmp_path / "v" / "config.json").read_text())["dflash_config"]["target_feature_reduction"]
        == "hc_mean"
    )
