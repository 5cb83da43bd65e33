"""Where the K20 check's greedy requests nearly tie: the tiny Qwen3 target's top-two gaps in float64, on the CPU.

    python benchmarks/dflash2/k20_near_ties.py [--dtype float32] [--requests 2] [--tokens 320] [--at 103,268]

`k20_gpu_check.py` serves the tiny Qwen3 target with and without speculation; a speculative run
verifies drafts at other query lengths than the unspeculated one, so its kernels round differently
and a token where the target's two best logprobs nearly tie may come out the other way. This
script takes the same checkpoint (built by the same function, so the same weights for the dtype),
upcasts it to float64 in transformers and decodes each named request greedily, printing the
smallest top-two logprob gaps along its trajectory and the gaps at ``--at``: an independent account
of which tokens are near ties, for a GPU run that did not record them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks.dflash2.k20_gpu_check import build, request_prompts  # noqa: E402


def top_two_gaps(target: Path, prompt: list[int], tokens: int) -> list[float]:
    """Per greedy token of the target in float64, the gap between its two largest logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float64).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    gaps = []
    for logits in out.logits:
        top = torch.log_softmax(logits[0].double(), dim=-1).topk(2).values
        gaps.append(float(top[0] - top[1]))
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", help="the checkpoint's dtype (its weights, then upcast)")
    parser.add_argument("--requests", default="2", help="comma-separated request indices, 0-7")
    parser.add_argument("--tokens", type=int, default=320)
    parser.add_argument("--at", default="", help="comma-separated token positions to print the gaps of")
    parser.add_argument("--show", type=int, default=8, help="how many of the smallest gaps to print")
    parser.add_argument("--work", type=Path, default=Path("/tmp/k20_gpu_check"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    target, _ = build(args.work, args.dtype)
    prompts = request_prompts()
    at = [int(i) for i in args.at.split(",") if i]
    for request in (int(r) for r in args.requests.split(",")):
        gaps = top_two_gaps(target, prompts[request], args.tokens)
        smallest = sorted(range(len(gaps)), key=gaps.__getitem__)[: args.show]
        print(f"request {request} ({args.dtype} weights in float64): smallest top-two gaps (token: gap) "
              + ", ".join(f"{i}: {gaps[i]:.3g}" for i in smallest))  # fmt: skip
        if at:
            print(f"request {request}: gaps at " + ", ".join(f"{i}: {gaps[i]:.3g}" for i in at if i < len(gaps)))


if __name__ == "__main__":
    main()
