"""Point the soak at any running vLLM server:

    python -m tests.soak.run --url http://127.0.0.1:8000 --requests 60 --concurrency 16 --seed 0

Prints a summary (and `--json` a full report) and exits 1 when a request returned other
tokens than alone, failed, `/health` failed, or the KV cache usage did not return to idle.
Tool-call requests force their output through the test-support logits processor; start the
server with `--logits-processors tests.tool_parsers.forced_output:ForcedOutputLogitsProcessor`
(this repository on its PYTHONPATH), or pass `--no-forced-output`. `benchmarks/soak_gpu.py` starts
the soak's server itself and also sends the bad requests of `tests/soak/faults.py`, each followed by
a normal request.
"""

from __future__ import annotations

import argparse
import json
import sys

from tests.soak.driver import SoakConfig, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="served model name (default: the server's first)")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=24, help="upper bound of each request's max_tokens")
    parser.add_argument("--long-prompt-tokens", type=int, default=800, help="cap on long prompts")
    parser.add_argument("--reference-url", help="a fresh server for the reference pass (default: --url)")
    parser.add_argument("--no-forced-output", dest="forced_output", action="store_false")
    parser.add_argument("--json", help="write the full report here")
    args = parser.parse_args(argv)
    config = SoakConfig(
        base_url=args.url,
        model=args.model,
        requests=args.requests,
        concurrency=args.concurrency,
        seed=args.seed,
        max_tokens=args.max_tokens,
        long_prompt_tokens=args.long_prompt_tokens,
        forced_output=args.forced_output,
        reference_url=args.reference_url,
    )
    report = run(config)
    print(report.summary())
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report.to_json(), out, indent=1, default=str)
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
