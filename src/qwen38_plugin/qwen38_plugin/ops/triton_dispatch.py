"""One rule for every op here that has a Triton fast path beside its plain-torch reference.

``backend="auto"`` runs Triton for CUDA tensors (unless the op's reference variable is set to
``1``, to compare against the reference inside a served model) and the torch reference
otherwise; ``"torch"`` always runs the reference; ``"triton"`` always runs the kernel (on CPU
tensors that needs ``TRITON_INTERPRET=1``, which is how the tests check kernels here).
"""

from __future__ import annotations

import os

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAVE_TRITON = False

BACKENDS = ("auto", "torch", "triton")


def use_triton(x_is_cuda: bool, backend: str, *, reference_env: str, op: str) -> bool:
    """Whether ``op`` runs its Triton path for a tensor on CUDA (``x_is_cuda``) or not."""
    if backend not in BACKENDS:
        raise ValueError(f"{op} backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if not HAVE_TRITON:
        if backend == "triton":
            raise RuntimeError(f"{op}: backend='triton' needs the triton package")
        return False
    return backend == "triton" or (x_is_cuda and os.environ.get(reference_env, "0") != "1")
