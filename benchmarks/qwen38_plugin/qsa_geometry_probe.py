"""Probe: one QSA layer's step as `PortableQSAAttention.attend` runs it, in the cache geometry vLLM
chose for DFlash on the H200, on the Triton path against the torch references and against
`ops.qsa`'s per-sequence oracle.

The geometry (``--kv-block 80 --key-block 640 --ring 160``, the defaults): K/V blocks of 80
tokens and 2 KV heads, block keys in 640-token blocks (160 rows at ratio 4), a 160-row key ring,
every cache a per-layer view whose H and N axes are swapped physically (vLLM's LBNHC; dim 0
steps over other layers' pages), NaN-poisoned, block ids drawn from one shuffled pool. The
metadata comes from `qsa_step_metadata.step_metadata` per cache group with the group's block
size (the builder's ``kv_cache_spec.block_size``), the ops read the caches' own shape[2]. Steps
mix prefill chunks with 5-token verify rows (4 drafts); after each verify row a random prefix is
accepted (the oracle commits only that), so groups straddle steps and the ring is read across them.

Per step it prints the worst relative error of the Triton side against the torch side and of
both against the oracle (rows whose selection differs are counted apart and checked to be exact
ties at the budget's edge, where the Triton path documents choosing the lowest groups); at the
end, whether the three caches hold the same bytes on both sides.

    TRITON_INTERPRET=1 python benchmarks/qwen38_plugin/qsa_geometry_probe.py --dtype float16 --h200
    python benchmarks/qwen38_plugin/qsa_geometry_probe.py --device cuda --dtype float16   # natively

``--h200`` makes the interpreter take the launch choices of an sm_90 device with 132 SMs (the
index scores on split fp16 queries through tl.dot, 64-key attention tiles). Interpreter runs
of 8 steps take about two minutes on one CPU core.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qwen38_plugin.ops import qsa, qsa_paged, qsa_step_metadata

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's tests package
from tests.qwen38_plugin.qsa_paged_harness import selection_mask

Kind = qsa_step_metadata.CacheKind
EPS = 1e-6
THETA = 1e7
NAMES = ("q", "gate", "k", "v", "iq", "raw")


@dataclass(frozen=True)
class Geo:
    heads: int = 4
    kv_heads: int = 2
    dim: int = 64
    index_heads: int = 2
    index_dim: int = 32
    ratio: int = 4
    topk: int = 4
    kv_block: int = 80
    key_block: int = 640  # tokens per block-keys block (key_block // ratio rows)
    ring: int = 160
    rotary: int = 16
    max_len: int = 4096
    permuted: bool = True  # LBNHC: [B, N, H, C] physically
    interleave: int = 3  # pages from one block of a layer to its next


def layer_view(
    blocks: int, heads: int, rows: int, feat: int, dtype: torch.dtype, geo: Geo, device: str
) -> torch.Tensor:
    """A NaN-filled ``[blocks, heads, rows, feat]`` view as vLLM binds one layer's cache."""
    page = heads * rows * feat
    storage = torch.full((blocks * page * geo.interleave + page,), float("nan"), dtype=dtype, device=device)
    inner = (feat, heads * feat) if geo.permuted else (rows * feat, feat)
    return torch.as_strided(storage, (blocks, heads, rows, feat), (page * geo.interleave, *inner, 1), 8)


@dataclass
class Paged:
    geo: Geo
    dtype: torch.dtype
    backend: str
    device: str
    num_requests: int
    gen: torch.Generator
    kv: torch.Tensor = field(init=False)
    keys: torch.Tensor = field(init=False)
    ring: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        g, n = self.geo, self.num_requests
        kv_per, key_per = -(-g.max_len // g.kv_block), -(-g.max_len // g.key_block)
        pool = 1 + n * (kv_per + key_per + 1) + 5  # one block pool: ids unique across the groups
        ids = 1 + torch.randperm(pool - 1, generator=self.gen)
        self.kv_table = ids[: n * kv_per].view(n, kv_per)
        self.key_table = ids[n * kv_per : n * (kv_per + key_per)].view(n, key_per)
        self.ring_ids = ids[n * (kv_per + key_per) : n * (kv_per + key_per + 1)].view(n, 1)
        self.kv = layer_view(pool, g.kv_heads, g.kv_block, 2 * g.dim, self.dtype, g, self.device)
        self.keys = layer_view(pool, 1, g.key_block // g.ratio, g.index_dim, self.dtype, g, self.device)
        self.ring = layer_view(pool, 1, g.ring, g.index_dim, self.dtype, g, self.device)

    def metadata(
        self, kind: Kind, common: dict[str, torch.Tensor], table: torch.Tensor, block_size: int, num_tokens: int
    ) -> dict[str, torch.Tensor]:
        """What `QSAMetadataBuilder.build` makes for one group, in buffers longer than the step."""
        dev, rows = self.device, num_tokens + 9
        buffers = {
            "token_req": torch.full((rows,), 77, dtype=torch.int32, device=dev),
            "step_start": torch.full((64,), 77, dtype=torch.int32, device=dev),
            "positions": torch.full((rows,), 77, dtype=torch.int64, device=dev),
            "slots": torch.full((rows,), 77, dtype=torch.int64, device=dev),
        }
        table = table.int().to(dev)
        qsa_step_metadata.step_metadata(
            kind, common["qsl"], common["seq_lens"], table, common["slot_mapping"] if kind is Kind.KV else None,
            num_tokens, block_size=block_size, ratio=self.geo.ratio, max_reqs=64, backend=self.backend, **buffers,
        )  # fmt: skip
        reqs = common["seq_lens"].shape[0]
        meta = {name: t[:num_tokens] for name, t in buffers.items() if name != "step_start"}
        return {**meta, "step_start": buffers["step_start"][:reqs], "table": table}

    def step(self, rows: list[tuple[int, int, int]], x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: (request, start, count) in row order; x: the step's per-token inputs. Returns
        (out, selected) on the CPU."""
        g, b, dev = self.geo, self.backend, self.device
        ids = torch.tensor([r for r, _, _ in rows])
        counts = torch.tensor([c for _, _, c in rows])
        n = int(counts.sum())
        positions = torch.cat([torch.arange(s, s + c) for _, s, c in rows])
        req = torch.arange(len(rows)).repeat_interleave(counts)
        kv_table = self.kv_table[ids]
        common = {
            "qsl": torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).int().to(dev),
            "seq_lens": torch.tensor([s + c for _, s, c in rows], dtype=torch.int32, device=dev),
            # vLLM's slot mapping of the K/V group
            "slot_mapping": (kv_table[req, positions // g.kv_block] * g.kv_block + positions % g.kv_block).to(dev),
        }
        meta = self.metadata(Kind.KV, common, kv_table, g.kv_block, n)
        keys_meta = self.metadata(Kind.BLOCK_KEYS, common, self.key_table[ids], g.key_block, n)
        ring_meta = self.metadata(Kind.KEY_RING, common, self.ring_ids[ids], g.ring, n)
        positions = positions.to(dev)
        assert torch.equal(meta["positions"], positions)
        x = {name: t.to(dev) for name, t in x.items()}
        # `PortableQSAAttention.attend`, op for op
        qsa_paged.write_kv(self.kv, meta["slots"], x["k"], x["v"], backend=b)
        ring_block = ring_meta["table"][:, 0]
        group_keys = qsa_paged.group_keys(
            x["raw"], self.ring, ring_block, meta["token_req"], positions, meta["step_start"], ratio=g.ratio,
            k_norm_weight=x["w"], eps=EPS, rope_theta=THETA, rotary_dim=g.rotary, backend=b,
        )  # fmt: skip
        qsa_paged.write_rows(self.keys, keys_meta["slots"], group_keys, backend=b)
        qsa_paged.write_rows(self.ring, ring_meta["slots"], x["raw"], backend=b)
        selected = qsa_paged.index_topk(
            x["iq"], self.keys, keys_meta["table"], meta["token_req"], positions, ratio=g.ratio, topk=g.topk,
            max_groups=g.max_len // g.ratio, backend=b,
        )  # fmt: skip
        out = torch.empty(n, g.heads * g.dim, dtype=self.dtype, device=dev)
        qsa_paged.sparse_attention(
            x["q"], x["gate"], self.kv, meta["table"], meta["token_req"], positions, selected, ratio=g.ratio,
            scale=g.dim**-0.5, out=out, backend=b,
        )  # fmt: skip
        return out.cpu(), selected.cpu()


def oracle_row(
    geo: Geo, committed: dict[str, torch.Tensor] | None, row: dict[str, torch.Tensor], start: int, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ops.qsa.attend_ring` over the committed prefix (one chunk), then the row: (out, token
    mask, every complete group's key)."""
    kwargs = {"index_k_norm_weight": w, "rotary_dim": geo.rotary, "rope_theta": THETA, "eps": EPS,
              "budget": geo.topk * geo.ratio, "ratio": geo.ratio}  # fmt: skip
    past_k = past_v = past = None
    if committed is not None and start > 0:
        prefix = qsa.PreparedTokens(*(committed[name][:start] for name in NAMES))
        _, past_k, past_v, step = qsa.attend_ring(prefix, torch.arange(start), **kwargs)  # type: ignore[arg-type]
        assert step is not None
        past = qsa.IndexerPast(step.block_keys, step.open_keys)
    positions = torch.arange(start, start + row["q"].shape[0])
    prepared = qsa.PreparedTokens(*(row[name] for name in NAMES))
    out, _, _, step = qsa.attend_ring(
        prepared,
        positions,
        past_k=past_k,
        past_v=past_v,
        past_indexer=past,
        **kwargs,  # type: ignore[arg-type]
    )
    assert step is not None
    keys = step.block_keys if past is None else torch.cat([past.block_keys, step.block_keys])
    mask = qsa.select_with_index_queries(
        row["iq"], keys, start + positions.shape[0], positions, budget=geo.topk * geo.ratio, ratio=geo.ratio
    )
    return out, mask, keys


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.float(), expected.float()
    assert torch.isfinite(actual).all(), "non-finite output"
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def ties_only(
    geo: Geo, selected: torch.Tensor, iq: torch.Tensor, keys: torch.Tensor, start: int, rows: list[int]
) -> bool:
    """Whether each row's chosen groups score exactly what the oracle's topk scores (ties)."""
    for i in rows:
        complete = (start + i + 1) // geo.ratio
        scores = torch.relu(torch.einsum("hd,gd->gh", iq[i].float(), keys[:complete].float())).sum(-1)
        if sorted(scores[selected[i].long()].tolist()) != sorted(scores.topk(geo.topk).values.tolist()):
            return False
    return True


def run(
    geo: Geo, dtype: torch.dtype, device: str, seed: int, prompts: list[int], chunk: int, steps: int, spec: int
) -> int:
    gen = torch.Generator().manual_seed(seed)
    n = len(prompts)
    w = (torch.randn(geo.index_dim, generator=gen) * 0.2).to(dtype)
    sides = {
        "triton": Paged(geo, dtype, "triton", device, n, torch.Generator().manual_seed(seed + 1)),
        "torch": Paged(geo, dtype, "torch", "cpu", n, torch.Generator().manual_seed(seed + 1)),
    }
    committed: list[dict[str, torch.Tensor] | None] = [None] * n
    length = [0] * n
    worst = {"triton_vs_torch": 0.0, "torch_vs_oracle": 0.0, "triton_vs_oracle": 0.0}
    ties = not_ties = 0
    for number in range(steps):
        rows = []
        for r in torch.randperm(n, generator=gen).tolist():
            if length[r] < prompts[r]:
                rows.append((r, length[r], min(chunk, prompts[r] - length[r])))
            elif length[r] < geo.max_len - spec - 1:
                rows.append((r, length[r], spec + 1))
        rows.sort(key=lambda row: length[row[0]] < prompts[row[0]])  # verify rows first, as vLLM orders them
        total = sum(c for _, _, c in rows)

        def randn(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dt)

        x = {
            "q": randn(total, geo.heads, geo.dim), "gate": randn(total, geo.heads * geo.dim),
            "k": randn(total, geo.kv_heads, geo.dim), "v": randn(total, geo.kv_heads, geo.dim),
            "iq": randn(total, geo.index_heads, geo.index_dim, dt=torch.float32), "raw": randn(total, geo.index_dim),
        }  # fmt: skip
        results = {name: side.step(rows, {**x, "w": w}) for name, side in sides.items()}
        first = 0
        for r, start, count in rows:
            part = slice(first, first + count)
            first += count
            row = {name: t[part] for name, t in x.items()}
            want, mask, keys = oracle_row(geo, committed[r], row, start, w)
            for name, (out, selected) in results.items():
                got = selection_mask(selected[part], torch.arange(start, start + count), geo.ratio, start + count)
                if not torch.equal(got, mask):
                    bad = (got != mask).any(1).nonzero().flatten().tolist()
                    tied = ties_only(geo, selected[part], row["iq"], keys, start, bad)
                    ties, not_ties = ties + tied, not_ties + (not tied)
                    print(f"  {name}: request {r} [{start}, {start + count}) selection differs at rows {bad}: "
                          f"{'exact ties' if tied else 'NOT TIES'}")  # fmt: skip
                    continue
                key = f"{name}_vs_oracle"
                worst[key] = max(worst[key], rel(out[part], want))
            if torch.equal(results["triton"][1][part], results["torch"][1][part]):
                worst["triton_vs_torch"] = max(
                    worst["triton_vs_torch"], rel(results["triton"][0][part], results["torch"][0][part])
                )
            # commit a prefill chunk whole, a verify row's accepted drafts plus the bonus token
            keep = count if start < prompts[r] else 1 + int(torch.randint(0, spec + 1, (1,), generator=gen))
            new = {name: t[:keep] for name, t in row.items()}
            old = committed[r]
            committed[r] = new if old is None else {name: torch.cat([old[name][:start], new[name]]) for name in new}
            length[r] = start + keep
        print(f"step {number}: rows {rows}: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()), flush=True)
    same = True
    for name in ("kv", "keys", "ring"):
        a, b = getattr(sides["triton"], name).cpu(), getattr(sides["torch"], name)
        nan_same = torch.equal(a.isnan(), b.isnan())
        diff = (a.nan_to_num().float() - b.nan_to_num().float()).abs().max().item()
        same &= nan_same
        print(f"cache {name}: rows written alike {nan_same}, max abs difference {diff:.3g}")
    print(f"selections unlike the oracle's: {ties} exact ties, {not_ties} not ties")
    print("worst: " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
    return 0 if same and not not_ties else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cpu", help="the Triton side's device (cpu: TRITON_INTERPRET=1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", default="3,29,17,100,700", help="prompt lengths, one request each")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--spec", type=int, default=4, help="drafts per verify row")
    parser.add_argument("--kv-block", type=int, default=80)
    parser.add_argument("--key-block", type=int, default=640)
    parser.add_argument("--ring", type=int, default=160)
    parser.add_argument("--no-permute", action="store_true", help="H outside N physically (LBHNC)")
    parser.add_argument("--h200", action="store_true", help="the interpreter takes an sm_90 device's launch choices")
    args = parser.parse_args()
    if args.h200:
        qsa_paged._capability = lambda device: (9, 0)  # type: ignore[assignment]
        qsa_paged._multiprocessors = lambda device: 132  # type: ignore[assignment]
    geo = Geo(kv_block=args.kv_block, key_block=args.key_block, ring=args.ring, permuted=not args.no_permute)
    print(geo)
    prompts = [int(p) for p in args.prompts.split(",")]
    return run(geo, getattr(torch, args.dtype), args.device, args.seed, prompts, args.chunk, args.steps, args.spec)


if __name__ == "__main__":
    raise SystemExit(main())
