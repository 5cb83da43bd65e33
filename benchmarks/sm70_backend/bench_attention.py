"""FLASH_ATTN_V100's kernels on a CUDA GPU against torch SDPA and the ceilings measured there,
plus the V100 roofline estimate (no V100 exists in this project's reach).

    PYTHONPATH=src/sm70_backend:. python benchmarks/sm70_backend/bench_attention.py [--estimate-only]

Geometry: one attention layer of a Qwen3-8B-like model (Hq 32, Hkv 8, D 128, KV block 16) at TP1,
fp16; every request owns shuffled blocks. Cases: decode of 1 and 8 requests at 8K and 128K
contexts (KV splits as the backend chooses them), a 4096-token causal prefill, and a DFlash-style
non-causal block of 16 tokens over an 8K context.

Per case: ``ours`` = the paged kernel (+ merge), median of CUDA-graph replays of 10 calls (launch
gaps out); ``sdpa`` = torch's scaled_dot_product_attention on the same K/V laid out densely (the
fastest torch attention, not paged: a lower bound on what a paged kernel must cost), same timing;
``need MB`` = K/V read once plus q and out; ``copy frac`` = need / (ours * copy bandwidth measured
here: a 1 GiB device-to-device copy, bytes read + written); ``fp16 frac`` = attention FLOPs / (ours
* fp16 matmul rate measured here, an 8192^3 torch.matmul); ``err`` = max|ours - sdpa| / max|sdpa|.

On sm_90 the m8n8k4 instruction is emulated with shuffles and FFMA (test_kernel_compile.py shows
the SASS), so these timings check that the kernel is not pathologically slow; they do not measure
V100 speed. The V100 estimate is the roofline: max(bytes / 900 GB/s, FLOPs / 125 TFLOP/s), printed
for decode at 8K and 128K and the prefill, with ``--estimate-only`` on any machine.
With ``$OUT`` set, the table is also written to ``$OUT/bench_attention.txt``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import V100_BW, V100_FP16, ceilings, median_ms

HQ, HKV, D, BLOCK = 32, 8, 128, 16


@dataclass
class Case:
    name: str
    reqs: int
    q_len: int
    context: int  # tokens already in the cache before the step
    causal: bool = True

    @property
    def seq_len(self) -> int:
        return self.context + self.q_len

    def bytes_needed(self) -> int:
        kv = self.reqs * self.seq_len * HKV * D * 2 * 2  # K and V, fp16
        qo = 2 * self.reqs * self.q_len * HQ * D * 2
        return kv + qo

    def flops(self) -> float:
        # Q K^T and P V: 2 * 2 * D per (query, visible key, head); causal prefill sees half of its own block.
        visible = self.q_len * self.context + (self.q_len * (self.q_len + 1) / 2 if self.causal else self.q_len**2)
        return 4.0 * D * HQ * self.reqs * visible


CASES = [
    Case("decode 1 x 8K", 1, 1, 8191),
    Case("decode 8 x 8K", 8, 1, 8191),
    Case("decode 1 x 128K", 1, 1, 131071),
    Case("decode 8 x 128K", 8, 1, 131071),
    Case("prefill 4096", 1, 4096, 0),
    Case("dflash block 16 / 8K", 4, 16, 8192, causal=False),
]


def v100_estimate(case: Case) -> tuple[float, str]:
    t_mem, t_math = case.bytes_needed() / V100_BW, case.flops() / V100_FP16
    return max(t_mem, t_math), "memory" if t_mem >= t_math else "tensor"


def estimate_table() -> list[str]:
    lines = [
        "V100 roofline (900 GB/s, 125 fp16 tensor TFLOP/s), one layer, Hq 32 / Hkv 8 / D 128, TP1:",
        f"{'case':24} {'need MB':>9} {'GFLOP':>8} {'floor us':>9} {'bound':>7}",
    ]
    for case in CASES:
        floor, bound = v100_estimate(case)
        lines.append(
            f"{case.name:24} {case.bytes_needed() / 1e6:9.1f} {case.flops() / 1e9:8.2f} {floor * 1e6:9.1f} {bound:>7}"
        )
    lines.append(
        "At TP4 (Hkv 2 per rank) each rank moves a quarter of the bytes: divide the decode floors by 4. "
        "Decode is memory-bound at every context, so FLASH_ATTN_V100's decode target is the copy ceiling; "
        "the prefill floor assumes the tensor cores are kept busy (the m8n8k4 pipeline), the bar the "
        "kernel is to be measured against on a V100."
    )
    return lines


def run_case(case: Case, copy_bw: float, fp16_rate: float) -> str:
    from sm70_backend.kernels import attention
    from tests.sm70_backend.attention_cases import make_batch, new_kv

    torch.manual_seed(0)
    batch = make_batch([case.q_len] * case.reqs, [case.context] * case.reqs, HQ, HKV, D, BLOCK, extra_blocks=1)
    batch = batch.to("cuda")
    k_new, v_new = new_kv(batch)
    attention.write_kv(k_new, v_new, batch.kv_cache, batch.slot_mapping)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tokens = batch.q.shape[0]
    splits = attention.choose_splits(tokens, case.reqs, HQ, HKV, sms)
    partials = attention.workspace(tokens, HQ, D, splits, torch.device("cuda")) if splits > 1 else None
    out = torch.empty_like(batch.q)

    def ours() -> None:
        attention.paged_attention(
            batch.q, batch.kv_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, batch.scale,
            causal=case.causal, out=out, num_splits=splits, partials=partials,
        )  # fmt: skip

    # Dense K/V for SDPA: [reqs, Hq, S, D] (GQA expanded as SDPA's enable_gqa would read it).
    q = batch.q.view(case.reqs, case.q_len, HQ, D).transpose(1, 2)
    k = torch.stack(batch.k).to("cuda").permute(0, 2, 1, 3).contiguous()
    v = torch.stack(batch.v).to("cuda").permute(0, 2, 1, 3).contiguous()
    mask = None
    if case.causal and case.q_len > 1:
        pos = torch.arange(case.context, case.seq_len, device="cuda").unsqueeze(1)
        mask = torch.arange(case.seq_len, device="cuda").unsqueeze(0) <= pos

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=batch.scale, enable_gqa=True
        )

    def sdpa_call() -> None:
        sdpa()

    ours()
    want = sdpa().transpose(1, 2).reshape(tokens, HQ, D)
    torch.cuda.synchronize()
    err = float((out.float() - want.float()).abs().max() / want.float().abs().max())
    t_ours = median_ms(ours)
    t_sdpa = median_ms(sdpa_call)
    need = case.bytes_needed()
    floor, bound = v100_estimate(case)
    return (
        f"{case.name:24} {splits:6d} {t_ours * 1e3:9.1f} {t_sdpa * 1e3:9.1f} {t_sdpa / t_ours:6.2f} "
        f"{need / 1e6:9.1f} {need / (t_ours * 1e-3) / copy_bw:9.3f} "
        f"{case.flops() / (t_ours * 1e-3) / fp16_rate:9.3f} {err:9.2e} {floor * 1e6:9.1f} {bound:>7}"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--estimate-only", action="store_true", help="print the V100 roofline only (no GPU)")
    args = parser.parse_args()
    lines = estimate_table()
    if not args.estimate_only:
        if not torch.cuda.is_available():
            print("\n".join(lines))
            print("no CUDA device: only the V100 estimate above (run on a GPU for the measured table)")
            return 1
        copy_bw, fp16_rate = ceilings()
        name = torch.cuda.get_device_name(0)
        lines += [
            "",
            f"{name}: copy {copy_bw / 1e9:.0f} GB/s (read + write), fp16 matmul {fp16_rate / 1e12:.0f} TFLOP/s",
            f"{'case':24} {'splits':>6} {'ours us':>9} {'sdpa us':>9} {'sdpa/o':>6} {'need MB':>9} "
            f"{'copy frac':>9} {'fp16 frac':>9} {'err':>9} {'V100 us':>9} {'bound':>7}",
        ]
        for case in CASES:
            lines.append(run_case(case, copy_bw, fp16_rate))
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_attention.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
