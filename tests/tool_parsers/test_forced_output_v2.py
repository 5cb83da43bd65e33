"""The forced-output test helper's V2-runner class (vLLM's default model runner on GPUs, which the
CPU engine here does not run): it forces what the V1 class forces, row by row, from the host-side
batch layout vLLM's V2 sampler hands it (its own `LogitsContext`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

from tests.tool_parsers.forced_output import ForcedOutputLogitsProcessorV2

EOS, VOCAB = 7, 16


def context(slots: list[int], seq_lens: list[int]) -> LogitsContext:
    rows = torch.arange(len(slots))
    return LogitsContext(
        expanded_idx_mapping=torch.tensor(slots), idx_mapping=torch.tensor(slots), idx_mapping_np=np.array(slots),
        expanded_local_pos=torch.zeros_like(rows), input_ids=torch.zeros_like(rows), pos=torch.zeros_like(rows),
        seq_lens_upper_bound_np=np.array(seq_lens),
    )  # fmt: skip


def test_forces_each_output_index_then_eos_and_leaves_other_rows_alone() -> None:
    prompt_len = SimpleNamespace(np=np.zeros(8, dtype=np.int32))
    config = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace(eos_token_id=[EOS])))
    proc = ForcedOutputLogitsProcessorV2(config, SimpleNamespace(prompt_len=prompt_len))  # type: ignore[arg-type]
    forced = SamplingParams(extra_args={"forced_token_ids": [3, 11]})
    assert proc.add_request(5, forced) is True
    assert proc.add_request(2, SamplingParams()) is False
    prompt_len.np[5], prompt_len.np[2] = 4, 9
    # slot 5 samples outputs 0, 1, 2 (visible length 4, 5, 6), and one prefill chunk that samples nothing
    for seq_len, want in ((4, 3), (5, 11), (6, EOS)):
        logits = torch.randn(2, VOCAB)
        before = logits.clone()
        out = proc.apply(logits, context([2, 5], [10, seq_len]))
        assert torch.equal(out[0], before[0])  # the other request's row is untouched
        assert int(out[1].argmax()) == want and torch.isinf(out[1]).sum() == VOCAB - 1
    logits = torch.randn(1, VOCAB)
    assert torch.equal(proc.apply(logits.clone(), context([5], [2])), logits)
    # a recycled slot forgets the forced ids of its last request
    assert proc.add_request(5, SamplingParams()) is False
    logits = torch.randn(1, VOCAB)
    assert torch.equal(proc.apply(logits.clone(), context([5], [4])), logits)


def test_bad_ids_are_refused_by_name() -> None:
    with pytest.raises(VLLMValidationError, match=r"vllm_xargs\.forced_token_ids"):
        ForcedOutputLogitsProcessorV2.validate_params(SamplingParams(extra_args={"forced_token_ids": [-1]}))
