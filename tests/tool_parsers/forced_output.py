"""Test support (not product): a vLLM logits processor that makes the engine write exact tokens.

The tiny Qwen3 checkpoint is random, so by itself it never writes a `<tool_call>`
inside its reasoning, a malformed call, a call to an unknown function, or a value
that contains `</parameter>\\n</function>`; and structured outputs (xgrammar) cannot
force those either, since the grammar is not applied during reasoning and, applied
after it, would only allow well-formed calls. The server tests still have to drive
the real engine, the real detokenizer and stock serving code to such outputs, so
they load this class through vLLM's own extension point:

    --logits-processors tests.tool_parsers.forced_output:ForcedOutputLogitsProcessor

A request opts in through `vllm_xargs` (stock vLLM passes them on as
`SamplingParams.extra_args`; chat completions, `/v1/responses` and `/v1/messages`
all accept the field):

* `forced_token_ids`: list[int]. Output token i is `forced_token_ids[i]`; when the
  list ends, the model's EOS token is forced.
* `step_sleep_s`: float. The engine sleeps this long before each forced step, so a
  stream stalls (keep-alive tests) while the engine stays a real engine.

vLLM's V2 model runner (its default on GPUs) takes only processors of its own interface:
there, pass `tests.tool_parsers.forced_output:ForcedOutputLogitsProcessorV2` (`CLASS_PATH_V2`),
which does the same.

Requests without these keys are left alone. Forced tokens replace the whole
distribution (logit 0 for the forced token, -inf elsewhere), after any grammar
bitmask: requests that combine this with structured outputs must force tokens the
grammar accepts, as the tests do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

FORCED_IDS_KEY = "forced_token_ids"
SLEEP_KEY = "step_sleep_s"
CLASS_PATH = "tests.tool_parsers.forced_output:ForcedOutputLogitsProcessor"
CLASS_PATH_V2 = "tests.tool_parsers.forced_output:ForcedOutputLogitsProcessorV2"


def _forced_settings(params: SamplingParams) -> tuple[list[int], float] | None:
    extra = params.extra_args or {}
    if FORCED_IDS_KEY not in extra and SLEEP_KEY not in extra:
        return None
    ids = extra.get(FORCED_IDS_KEY, [])
    sleep = extra.get(SLEEP_KEY, 0.0)
    if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise VLLMValidationError(
            f"vllm_xargs.{FORCED_IDS_KEY} must be a list of token ids (non-negative integers)",
            parameter=f"vllm_xargs.{FORCED_IDS_KEY}",
        )
    if not isinstance(sleep, int | float) or sleep < 0:
        raise VLLMValidationError(
            f"vllm_xargs.{SLEEP_KEY} must be a non-negative number of seconds", parameter=f"vllm_xargs.{SLEEP_KEY}"
        )
    return list(ids), float(sleep)


class ForcedOutputLogitsProcessor(AdapterLogitsProcessor):
    """Force the token sequence a request names in `vllm_xargs` (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        _forced_settings(sampling_params)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        eos = getattr(vllm_config.model_config.hf_text_config, "eos_token_id", None)
        self._default_eos = eos[0] if isinstance(eos, list) else eos

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> Callable[[list[int], torch.Tensor], torch.Tensor]:
        settings = _forced_settings(params)
        if settings is None:
            return None  # type: ignore[return-value]
        ids, sleep = settings
        end = self._default_eos

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if sleep:
                time.sleep(sleep)
            if not ids or (step >= len(ids) and end is None):
                return logits
            token = ids[step] if step < len(ids) else end
            forced = torch.full_like(logits, float("-inf"))
            forced[token] = 0.0
            return forced

        return force


class ForcedOutputLogitsProcessorV2(V2LogitsProcessor):
    """`ForcedOutputLogitsProcessor` for vLLM's V2 model runner: per request slot, the forced ids;
    a row's output index is its visible length less the prompt's (exact without speculation)."""

    def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState) -> None:
        eos = getattr(vllm_config.model_config.hf_text_config, "eos_token_id", None)
        self._default_eos = eos[0] if isinstance(eos, list) else eos
        self._prompt_len = req_states.prompt_len
        self._forced: dict[int, tuple[list[int], float]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        _forced_settings(sampling_params)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        settings = _forced_settings(sampling_params)
        if settings is None:
            self._forced.pop(req_idx, None)  # a recycled slot keeps nothing of its last request
            return False
        self._forced[req_idx] = settings
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        slots = [int(slot) for slot in ctx.idx_mapping_np]
        if not any(slot in self._forced for slot in slots):
            return logits
        if logits.shape[0] != len(slots):
            raise ValueError("ForcedOutputLogitsProcessorV2 supports one logits row per request (no speculation)")
        for row, slot in enumerate(slots):
            if slot not in self._forced:
                continue
            ids, sleep = self._forced[slot]
            step = int(ctx.seq_lens_upper_bound_np[row]) - int(self._prompt_len.np[slot])
            if step < 0:  # a prefill chunk that samples nothing
                continue
            if sleep:
                time.sleep(sleep)
            if not ids or (step >= len(ids) and self._default_eos is None):
                continue
            token = ids[step] if step < len(ids) else self._default_eos
            logits[row].fill_(float("-inf"))
            logits[row, token] = 0.0
        return logits
