"""qwen38_plugin.cpu_seeded_sampling: the generator that undoes a discarded draw, and its install.

The served behaviour (a seeded request with a chunked prompt, which stock 0.32 answers by
killing the CPU engine, returns the tokens of an unchunked prefill) is tested on the soak
server, tests/soak/test_soak.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qwen38_plugin.cpu_seeded_sampling import STOCK_REWIND, RewindableCpuGenerator


def draw(generator: torch.Generator) -> int:
    # what vLLM's CPU sampler draws per seeded request and step
    return int(torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long).item())


def test_rewind_undoes_the_last_draw_and_nothing_else() -> None:
    stock = torch.Generator(device="cpu").manual_seed(7)
    ours = RewindableCpuGenerator.copy_of(torch.Generator(device="cpu").manual_seed(7))
    expected = [draw(stock) for _ in range(5)]
    got = []
    for _ in range(5):
        ours.remember()
        draw(ours)  # a step whose token is discarded (partial prefill) ...
        ours.set_offset(ours.get_offset() - 4)  # ... rewound as vLLM rewinds it
        ours.remember()
        got.append(draw(ours))  # the step that counts
    assert got == expected
    with pytest.raises(RuntimeError, match="only undoes the last sampling draw"):
        ours.set_offset(12)


def test_stock_cpu_generators_cannot_rewind() -> None:
    # what stock's _bookkeeping_sync runs into on CPU
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        torch.Generator(device="cpu").get_offset()


def test_install_patches_the_cpu_model_runner_when_vllm_imports_it() -> None:
    probe = (
        "from qwen38_plugin.cpu_seeded_sampling import install, _PATCHED\n"
        "print(install())\n"
        "from vllm.v1.worker.cpu_model_runner import CPUModelRunner\n"
        "print(getattr(CPUModelRunner.sample_tokens, _PATCHED, False))\n"
        "print(install())\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["installed", "on", "import", "True", "installed"]


def test_the_stock_code_it_fixes_is_this_vllms() -> None:
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert STOCK_REWIND in inspect.getsource(GPUModelRunner._bookkeeping_sync)
