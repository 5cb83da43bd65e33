"""`dflash2-view`: make a DFlash draft view (ReVolta 0.1.2's recipe, as one command).

A draft view is a directory that links a downloaded drafter's files and has its own config.json
with two more settings: ``dflash_config.target_feature_reduction = "hc_mean"`` (required for a
hyper-connection target such as Qwen3.8 Flash-Next) and ``max_position_embeddings`` (the context
the drafter is served at; vLLM caps the drafter's context at it). The weights are not copied.

    dflash2-view /models/Qwen3.8-Flash-Next-DFlash2 /views/dflash2-512k [--max-position-embeddings 524288]

Every regular file of the drafter but config.json is linked by its absolute path (the seed links
model.safetensors; linking all of them also keeps sharded weights and a `mask_embedding.pt`);
hidden entries (such as ``.cache`` from ``hf download --local-dir``) and directories are not.
The view is written next to its destination and renamed into place, so it appears complete or
not at all. In a container, mount the drafter at the same path so the links resolve.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash2.target_features import HC_MEAN, REDUCTION_KEY

DEFAULT_MAX_POSITION_EMBEDDINGS = 524_288  # the seed's served context (512K)
WEIGHT_SUFFIXES = (".safetensors", ".bin")


class ViewError(ValueError):
    """Why a view cannot be made: names the path or field and the fix."""


@dataclass(frozen=True)
class View:
    path: Path
    linked: tuple[str, ...]
    previous_max_position_embeddings: Any


def view_config(source: Path, max_position_embeddings: int) -> tuple[dict[str, Any], Any]:
    """The view's config.json (and the drafter's previous max_position_embeddings)."""
    config_path = source / "config.json"
    if not config_path.is_file():
        raise ViewError(f"{config_path}: not found; SRC must be a downloaded DFlash drafter directory")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ViewError(f"{config_path}: not readable JSON ({error})") from error
    if not isinstance(config, dict):
        raise ViewError(f"{config_path}: not a JSON object")
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ViewError(
            f"{config_path}: no dflash_config object, so this is not a DFlash drafter (a view only adds "
            f"dflash_config.{REDUCTION_KEY})"
        )
    existing = dflash.get(REDUCTION_KEY)
    if existing is not None and existing != HC_MEAN:
        raise ViewError(
            f"{config_path}: dflash_config.{REDUCTION_KEY} is already {existing!r}; the drafter was trained on "
            f"another reduction than {HC_MEAN!r}, and a view would misstate it"
        )
    if isinstance(max_position_embeddings, bool) or not isinstance(max_position_embeddings, int):
        raise ViewError(f"--max-position-embeddings must be an integer, got {max_position_embeddings!r}")
    if max_position_embeddings < 1:
        raise ViewError(f"--max-position-embeddings must be positive, got {max_position_embeddings}")
    previous = config.get("max_position_embeddings")
    config["dflash_config"] = {**dflash, REDUCTION_KEY: HC_MEAN}
    config["max_position_embeddings"] = max_position_embeddings
    return config, previous


def make_view(
    source: str | Path,
    destination: str | Path,
    *,
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
    overwrite: bool = False,
) -> View:
    """Write the view of the drafter in `source` to `destination` (atomically)."""
    src = Path(os.path.abspath(source))
    dst = Path(os.path.abspath(destination))
    if not src.is_dir():
        raise ViewError(f"{src}: not a directory; SRC must be a downloaded DFlash drafter directory")
    if dst == src or src in dst.parents:
        raise ViewError(f"{dst}: inside the drafter directory {src}; put the view elsewhere")
    if dst.exists() and not overwrite:
        raise ViewError(f"{dst}: already exists; pass --overwrite to replace it")
    if dst.exists() and not dst.is_dir():
        raise ViewError(f"{dst}: exists and is not a directory")
    config, previous = view_config(src, max_position_embeddings)
    files = sorted(
        entry.name
        for entry in src.iterdir()
        if not entry.name.startswith(".") and entry.name != "config.json" and entry.is_file()
    )
    if not any(name.endswith(WEIGHT_SUFFIXES) for name in files):
        raise ViewError(
            f"{src}: no weights ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}); download the drafter first"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        for name in files:
            (staging / name).symlink_to(src / name)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old.", dir=dst.parent))
            old.rmdir()
            dst.rename(old)
            staging.rename(dst)
            shutil.rmtree(old)
        else:
            staging.rename(dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return View(dst, tuple(files), previous)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dflash2-view",
        description=(
            "Make a DFlash draft view: DST links SRC's files and has its own config.json with "
            f'dflash_config.{REDUCTION_KEY} = "{HC_MEAN}" and max_position_embeddings (the served context).'
        ),
    )
    parser.add_argument("source", metavar="SRC", help="the downloaded drafter directory")
    parser.add_argument("destination", metavar="DST", help="the view directory to create")
    parser.add_argument(
        "--max-position-embeddings",
        type=int,
        default=DEFAULT_MAX_POSITION_EMBEDDINGS,
        help=f"the context the drafter is served at (default {DEFAULT_MAX_POSITION_EMBEDDINGS})",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    args = parser.parse_args(argv)
    try:
        view = make_view(
            args.source,
            args.destination,
            max_position_embeddings=args.max_position_embeddings,
            overwrite=args.overwrite,
        )
    except (ViewError, OSError) as error:
        print(f"dflash2-view: {error}", file=sys.stderr)
        return 2
    print(
        f"dflash2-view: {view.path}: links {', '.join(view.linked)}; config.json with "
        f'dflash_config.{REDUCTION_KEY} = "{HC_MEAN}", max_position_embeddings = {args.max_position_embeddings} '
        f"(drafter: {view.previous_max_position_embeddings})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
