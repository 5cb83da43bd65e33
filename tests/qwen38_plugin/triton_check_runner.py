"""The verdict loop the Triton check scripts share (`qsa_paged_triton_check.py`,
`fused_ops_triton_check.py`): each runs as a script (its folder first on ``sys.path``), and
the tests read its ``PASS name ...`` / ``FAIL name ...`` lines."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable


def run_checks(checks: dict[str, Callable[[], str]], device: str) -> int:
    """Runs every check (a failure does not stop the rest), one verdict line each; 1 if any failed."""
    failed = 0
    for name, check in checks.items():
        started = time.perf_counter()
        try:
            result = check()
            print(f"PASS {name} {result} ({time.perf_counter() - started:.1f} s)", flush=True)
        except Exception as error:  # report every check, then fail
            failed += 1
            print(f"FAIL {name} {error!r}\n{traceback.format_exc()}", flush=True)
    print(f"device={device} checks={len(checks)} failed={failed}")
    return 1 if failed else 0
