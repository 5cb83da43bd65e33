"""`dflash2.drafter_reference` drafts exactly what stock vLLM's DFlash drafter drafts.

One stock vLLM engine on CPU (about 40 s on 2 cores): the tiny Qwen4Exp target in fp32 and a random
one-layer causal DFlash drafter for it (``target_layer_ids`` [0, 2], ``hc_mean``; written from the
reference's own parameters, so both run the same weights; vLLM's V1 runner, the CPU's, wants all
drafter layers in one KV-cache group, which a hybrid target's grouping gives only one layer), 3
drafts, three greedy requests of different prompt lengths together. Every step's drafts are taken
from stock's scheduler as it schedules them for verification (``scheduled_spec_decode_tokens``),
with the request's length then.
The reference, fed the plain-torch oracle's ``hc_mean`` features of the same tokens, must propose
the same draft tokens at every step (most of them by a clear logit margin; a draft may differ only
where the reference's top two logits tie within fp32 noise).

It can fail: the same comparison with the reference misreading a layer id (no ``+ 1``) or placing the
query block one position late loses many drafts (checked below, so a test that could not tell them
apart would fail too).

A second engine (about 15 s) serves a drafter with a reduced draft vocabulary (``draft_vocab_size``
4,096, its own random lm_head, stock's ``d2t`` map): vLLM drafts only those tokens, the reference's
drafts; the reference through the target's lm_head instead loses them.

Run as a script (``python THIS MODEL DRAFTER PROMPTS_JSON MAX_TOKENS``) it is the engine side.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines import run_engine_script

HERE = Path(__file__).resolve()
# DRAFTER_CHECK_DRAFTS: another draft count for drafts_check.py --drafts (the tests use 3); read here so the
# engine side (a subprocess) and the drafter built for it agree
DRAFTS = int(os.environ.get("DRAFTER_CHECK_DRAFTS", "3"))
MAX_TOKENS = 12
PROMPT_LENGTHS = (5, 23, 41)
MASK_TOKEN_ID = 248063  # <|fim_pad|> of the Qwen3.6 tokenizer
DRAFT_VOCAB = 4096  # the reduced draft vocabulary's size (of the target's 248k tokens)


def engine_main() -> None:
    model, drafter, prompts_json, max_tokens = sys.argv[1:5]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process, to record it
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # DRAFTER_CHECK_DTYPE / DRAFTER_CHECK_GRAPHS: the same comparison on a GPU in its serving dtype with
    # CUDA graphs (benchmarks/qwen38_plugin/drafts_check.py); DRAFTER_CHECK_METHOD=mtp: the target's
    # own MTP head drafts instead (``drafter`` unused; tests/qwen38_plugin/test_qwen38_mtp_drafts_engine.py)
    # DRAFTER_CHECK_ENGINE_ARGS: more LLM arguments, JSON (tensor and decode-context parallelism)
    graphs = os.environ.get("DRAFTER_CHECK_GRAPHS") == "1"
    more = json.loads(os.environ.get("DRAFTER_CHECK_ENGINE_ARGS", "{}"))
    if os.environ.get("DRAFTER_CHECK_METHOD", "dflash") == "mtp":
        speculative = {"method": "mtp", "num_speculative_tokens": DRAFTS}
    else:
        speculative = {"method": "dflash", "model": drafter, "num_speculative_tokens": DRAFTS}
    llm = LLM(
        model=model,
        seed=0,
        dtype=os.environ.get("DRAFTER_CHECK_DTYPE", "float32"),
        enforce_eager=not graphs,
        # three requests verify 3 x (1 + DRAFTS) tokens a step: a few sizes, not vLLM's dozens
        **({"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 12, 16]}} if graphs else {}),
        enable_prefix_caching=False,  # with speculation on CPU, and beside a DFlash drafter
        async_scheduling=False,  # the scheduler then holds the real draft tokens, not placeholders
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=8,
        speculative_config=speculative,
        **more,
    )
    prompts = json.loads(prompts_json)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule
    drafts: list[dict[str, Any]] = []
    device_drafts = record_device_drafts()

    def recording_schedule(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        for req_id, tokens in output.scheduled_spec_decode_tokens.items():
            request = scheduler.requests[req_id]
            which = prompts.index(list(request.prompt_token_ids))
            # vLLM's V2 runner (CUDA) keeps the drafts on the device and hands the scheduler -1
            # placeholders: the drafts it verifies now are the last it proposed for the request
            proposed = list(tokens) if -1 not in tokens else device_drafts.get(req_id, list(tokens))
            drafts.append({"request": which, "length": request.num_tokens, "drafts": proposed})
        return output

    scheduler.schedule = recording_schedule
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    tokens = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
    print(json.dumps({"tokens": tokens, "drafts": drafts}))


def record_device_drafts() -> dict[str, list[int]]:
    """Each request's latest drafts as vLLM's V2 model runner (CUDA) proposes them, by request id
    (empty where that runner is not used: the V1 runner, on CPU, gives the scheduler the drafts).
    The runner hands every step's drafts to its ``DraftTokensHandler``, outside CUDA graphs, so
    reading them there costs one copy a step and changes nothing the engine computes."""
    latest: dict[str, list[int]] = {}
    try:
        from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler
    except ImportError:
        return latest
    handed = DraftTokensHandler.set_draft_tokens

    def recording(self: Any, input_batch: Any, draft_tokens: torch.Tensor) -> None:
        for req_id, row in zip(input_batch.req_ids, draft_tokens.tolist(), strict=True):
            latest[req_id] = row
        handed(self, input_batch, draft_tokens)

    DraftTokensHandler.set_draft_tokens = recording  # type: ignore[method-assign]
    return latest


def build_drafter(target: Path, path: Path, draft_vocab: int = 0) -> Any:
    """A random one-layer causal DFlash drafter for ``target``, written to the directory ``path``
    (fp32) and returned as the reference module. ``draft_vocab`` > 0: it drafts from that many
    random target tokens (in shuffled order, so the row -> token map matters) through its own random
    lm_head (not the target's rows, so a served drafter that used the target's head would differ)."""
    from safetensors.torch import save_file

    from dflash2.drafter_reference import DFlashDrafterReference
    from dflash2.tiny import drafter_config

    config = drafter_config(
        json.loads((target / "config.json").read_text()),
        num_hidden_layers=1,
        target_layer_ids=[0, 2],
        block_size=DRAFTS + 1,
        causal=True,
        # the pad token's embedding row is zero, so mask slots would get zero queries (uniform
        # attention, blind to positions): an ordinary special token's row is not
        extra_dflash_config={"target_feature_reduction": "hc_mean", "mask_token_id": MASK_TOKEN_ID},
    )
    config.update(dtype="float32", max_position_embeddings=256)
    if draft_vocab:
        config["draft_vocab_size"] = draft_vocab
    drafter = DFlashDrafterReference(config)
    gen = torch.Generator().manual_seed(0)
    drafter.reset_parameters(gen, std=0.1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(2.0)  # peaked attention: the drafts then depend visibly on where each key sits
    if draft_vocab:
        token_ids = torch.randperm(int(config["vocab_size"]), generator=gen)[:draft_vocab]
        own_rows = torch.randn(int(config["vocab_size"]), int(config["hidden_size"]), generator=gen)
        drafter.set_draft_vocabulary(token_ids, own_rows)
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return drafter.eval()


def engine_command(target: Path, drafter: Path, requests: int = len(PROMPT_LENGTHS)) -> list[str]:
    """The engine side (`engine_main`) for the first ``requests`` prompts of PROMPT_LENGTHS random
    tokens, served together."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 240_000, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS][:requests]
    return [sys.executable, str(HERE), str(target), str(drafter), json.dumps(prompts), str(MAX_TOKENS)]


def engine_result(stdout: str) -> dict[str, Any]:
    return json.loads([line for line in stdout.splitlines() if line.startswith('{"tokens"')][-1])


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple:
    target = tiny_checkpoint("qwen4_exp_text", dtype="float32")
    path = tmp_path_factory.mktemp("drafter_reference") / "drafter"
    drafter = build_drafter(target, path)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(HERE.parents[2])}
    proc = run_engine_script(engine_command(target, path), env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return target, drafter, engine_result(proc.stdout)


@pytest.fixture(scope="module")
def served_draft_vocab(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """The same engine with a drafter of a reduced draft vocabulary (`DRAFT_VOCAB` tokens, ``d2t``)."""
    target = tiny_checkpoint("qwen4_exp_text", dtype="float32")
    path = tmp_path_factory.mktemp("drafter_reference_vocab") / "drafter"
    drafter = build_drafter(target, path, draft_vocab=DRAFT_VOCAB)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(HERE.parents[2])}
    proc = run_engine_script(engine_command(target, path), env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return target, drafter, engine_result(proc.stdout)


@functools.cache
def oracle(target: Path) -> Any:
    """The plain-torch target (eval), loaded once for every test of this module."""
    from transformers import AutoConfig

    from qwen38_plugin.model import Qwen4ExpCore, iter_safetensors

    core = Qwen4ExpCore(AutoConfig.from_pretrained(target))
    core.load_checkpoint_tensors(iter_safetensors(target))
    return core.eval()


def reference_drafts(
    target: Path,
    drafter: Any,
    result: dict[str, Any],
    *,
    layer_shift: int = 1,
    position_shift: int = 0,
    target_head: bool = False,
) -> tuple[list[list[int]], list[float]]:
    """The reference's drafts at each recorded step, and the margin of each draft's logit over the
    runner-up; ``layer_shift``, ``position_shift`` and ``target_head`` (the target's lm_head where
    the drafter has its own) make deliberate mistakes."""
    from dflash2.drafter_reference import block_attention_mask, qwen4exp_aux_features

    core = oracle(target)
    indices = sorted(i + layer_shift for i in drafter.config["dflash_config"]["target_layer_ids"])
    embed, lm_head = core.model.embed_tokens.weight, core.lm_head.weight
    mask_id = drafter.geometry.mask_token_id
    drafts, margins = [], []
    with torch.no_grad():
        features = qwen4exp_aux_features(core, [torch.tensor(t) for t in result["tokens"]], indices)
        for step in result["drafts"]:
            tokens = torch.tensor(result["tokens"][step["request"]])
            a = step["length"] - 1  # the bonus token's position
            k = len(step["drafts"])
            block = torch.tensor([int(tokens[a])] + [mask_id] * k)
            positions = torch.arange(a, a + 1 + k) + position_shift
            hidden = drafter(  # context rows: positions 0 .. a - 1
                drafter.context_states(features[step["request"]][:a]).unsqueeze(0),
                torch.arange(a).unsqueeze(0),
                torch.nn.functional.embedding(block, embed).unsqueeze(0),
                positions.unsqueeze(0),
                block_attention_mask([a], a, 1 + k, causal=True).unsqueeze(0),
            )
            logits = hidden[0, 1:] @ lm_head.t() if target_head else drafter.logits(hidden[0, 1:], lm_head)
            top = logits.topk(2, dim=-1)
            drafts.append(top.indices[:, 0].tolist())
            margins.extend((top.values[:, 0] - top.values[:, 1]).tolist())
    return drafts, margins


def agreement(result: dict[str, Any], drafts: list[list[int]]) -> float:
    pairs = [
        (d, r)
        for step, ref in zip(result["drafts"], drafts, strict=True)
        for d, r in zip(step["drafts"], ref, strict=False)
    ]
    return sum(d == r for d, r in pairs) / len(pairs)


def test_reference_drafts_what_vllm_drafts(served: tuple) -> None:
    target, drafter, result = served
    steps = result["drafts"]
    assert len({s["request"] for s in steps}) == len(PROMPT_LENGTHS)
    assert sum(len(s["drafts"]) for s in steps) >= 60, steps  # enough drafts to mean something
    drafts, margins = reference_drafts(target, drafter, result)
    vllm = [d for s in steps for d in s["drafts"]]
    ours = [d for s, ref in zip(steps, drafts, strict=True) for d in ref[: len(s["drafts"])]]
    # equal, but where the reference's top two logits tie within fp32 noise (random weights, 248k tokens)
    mismatches = [(i, m) for i, (d, r, m) in enumerate(zip(vllm, ours, margins, strict=True)) if d != r]
    assert all(m < 1e-4 for _, m in mismatches), mismatches
    assert len(mismatches) <= 2, mismatches
    assert sum(m > 1e-3 for m in margins) >= 0.9 * len(margins)  # most argmaxes are clear: not luck
    # the convenience path (one request's step) is the same computation
    from dflash2.drafter_reference import aux_layer_indices, qwen4exp_aux_features

    core = oracle(target)
    step = steps[-1]
    tokens = result["tokens"][step["request"]][: step["length"]]
    with torch.no_grad():
        # one sequence alone, not in a batch of three: the same features
        (features,) = qwen4exp_aux_features(core, [torch.tensor(tokens)], aux_layer_indices(drafter.config))
        logits = drafter.draft_logits(
            features, tokens, len(step["drafts"]), core.model.embed_tokens.weight, core.lm_head.weight
        )
    assert logits.argmax(-1).tolist() == step["drafts"]


def test_a_reduced_draft_vocabulary_drafts_what_vllm_drafts(served_draft_vocab: tuple) -> None:
    """A drafter with its own lm_head over 4,096 target tokens and stock's ``d2t`` map: vLLM
    drafts only those tokens, and the same ones as the reference's `logits` (its ``-inf`` fill)."""
    target, drafter, result = served_draft_vocab
    steps = result["drafts"]
    assert sum(len(s["drafts"]) for s in steps) >= 60, steps
    vllm = [d for s in steps for d in s["drafts"]]
    allowed = set(drafter.draft_token_ids().tolist())
    assert set(vllm) <= allowed, sorted(set(vllm) - allowed)
    assert len(set(vllm)) >= 10, vllm  # drafts that depend on the input, not one token
    drafts, margins = reference_drafts(target, drafter, result)
    ours = [d for s, ref in zip(steps, drafts, strict=True) for d in ref[: len(s["drafts"])]]
    mismatches = [(i, m) for i, (d, r, m) in enumerate(zip(vllm, ours, margins, strict=True)) if d != r]
    assert all(m < 1e-4 for _, m in mismatches), mismatches
    assert len(mismatches) <= 2, mismatches
    # it can fail: the same reference through the target's lm_head (the draft vocabulary ignored)
    # loses the drafts
    wrong, _ = reference_drafts(target, drafter, result, target_head=True)
    assert agreement(result, wrong) < 0.25


@pytest.mark.parametrize(
    "mistake",
    [{"layer_shift": 0}, {"position_shift": 1}],
    ids=["layer-id-without-plus-one", "block-one-position-late"],
)
def test_a_wrong_mapping_loses_the_drafts(served: tuple, mistake: dict[str, Any]) -> None:
    target, drafter, result = served
    drafts, _ = reference_drafts(target, drafter, result, **mistake)
    assert agreement(result, drafts) < 0.75, mistake


if __name__ == "__main__":
    engine_main()
