"""Property: for any output and any chunking, the joined stream equals the non-streamed parse.

Outputs are built from known calls, so complete calls are also checked against the
arguments they were rendered from (not against what the parser returns elsewhere).
Among them are calls the parser must drop (to a function that is not among the
tools, a `<tool_call>` without a function name): the calls it keeps are numbered
0, 1, 2, ... in the stream as in the non-streamed list, whatever was dropped before.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tool_parsers.qwen38_harness import Parsed, Qwen38Harness, render_call

# Pieces of string values, including the text that used to cut values short.
FRAGMENTS = [
    "Paris",
    "a",
    " ",
    "<",
    ">",
    "a < b",
    "</function>",
    "</parameter>x",
    "</parameter>\n</function>",
    "</parameter>\n</function>\n",
    "<parameter=",
    "</tool_call",
    '{"k": [1, 2]}',
    '"',
    "\\",
    "\n",
    "日本語",
    "😀",
    "def f():\n    return 1",
]

# The one documented ambiguity: inside a value, `</parameter>` then `<parameter=`, or then a
# `</function>` that is followed by the end of a call, reads as the end of the value.
AMBIGUOUS = re.compile(r"</parameter>\s*(<parameter=|</function>\s*(</tool_call>|<tool_call>|<function=))")

string_values = (
    st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=5)
    .map("".join)
    .filter(lambda v: not v.startswith("\n") and not v.endswith("\n") and not AMBIGUOUS.search(v))
)


MALFORMED_CALL = "<tool_call>\nhello\n</tool_call>"


@st.composite
def calls(draw: st.DrawFn) -> tuple[str, dict[str, str], dict[str, Any] | None]:
    """(function name, rendered parameter texts, the arguments the parser must return).

    The arguments are None for a call the parser must drop: one to `delete_everything`
    (not among the tools) or, with the name "", a `<tool_call>` block without a function.
    """
    kind = draw(st.sampled_from(["get_weather", "write_file", "set_limits", "delete_everything", ""]))
    if kind == "delete_everything":
        return kind, {"path": draw(string_values)}, None
    if kind == "":
        return kind, {}, None
    if kind == "get_weather":
        city = draw(string_values)
        days = draw(st.integers(min_value=0, max_value=10**6))
        return kind, {"city": city, "days": str(days)}, {"city": city, "days": days}
    if kind == "write_file":
        path, content = draw(string_values), draw(string_values)
        return kind, {"path": path, "content": content}, {"path": path, "content": content}
    count = draw(st.integers(min_value=-5, max_value=500))
    strict = draw(st.booleans())
    rendered = {"count": str(count), "ratio": "0.25", "flags": f'{{"strict": {str(strict).lower()}}}'}
    return kind, rendered, {"count": count, "ratio": 0.25, "flags": {"strict": strict}}


def written(name: str, rendered: dict[str, str]) -> str:
    return render_call(name, rendered) if name else MALFORMED_CALL


def expected_issues(made_calls: list[tuple[str, dict[str, str], dict[str, Any] | None]]) -> list[dict[str, Any]]:
    """The README's report of each dropped call; `index` counts every call written."""
    issues: list[dict[str, Any]] = []
    for index, (name, _, arguments) in enumerate(made_calls):
        if arguments is None and name:
            issues.append({"issue": "unknown_function", "action": "dropped_call", "index": index, "name": name})
        elif arguments is None:
            malformed = {"issue": "malformed", "action": "dropped_call", "index": index, "name": None}
            issues.append({**malformed, "detail": "a <tool_call> without <function=NAME>"})
    return issues


@st.composite
def outputs(draw: st.DrawFn) -> dict[str, Any]:
    thinking = draw(st.booleans())
    made_calls = draw(st.lists(calls(), max_size=3))
    reasoning = draw(st.sampled_from(["Let me think.", "Check <the> weather", "x"]))
    preamble = draw(st.sampled_from(["", "Sure.", "Let me check.\n\n"]))
    implicit_end = thinking and bool(made_calls) and not preamble and draw(st.booleans())
    body = preamble + "\n".join(written(name, rendered) for name, rendered, _ in made_calls)
    if not thinking:
        text = body
        expected_reasoning = None
    elif implicit_end:
        text = reasoning + body  # <tool_call> ends the reasoning without </think>
        expected_reasoning = reasoning
    else:
        text = reasoning + "\n</think>\n\n" + body
        expected_reasoning = reasoning + "\n"
    return {
        "thinking": thinking,
        "text": text,
        "calls": made_calls,
        "reasoning": expected_reasoning,
        "tool_choice": draw(
            st.sampled_from(["auto", "required", "none", {"type": "function", "function": {"name": "get_weather"}}])
        ),
    }


def _normalized(parsed: Parsed) -> tuple[str | None, str | None, list[tuple[str, str]], list[int]]:
    return parsed.reasoning or None, parsed.content or None, parsed.calls, parsed.indices


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=outputs(), data=st.data())
def test_stream_joins_to_full_parse(harness: Qwen38Harness, case: dict[str, Any], data: st.DataObject) -> None:
    spelled = data.draw(st.booleans(), label="markers spelled with ordinary tokens")
    ids = harness.encode_spelled(case["text"]) if spelled else harness.encode(case["text"])
    truncate = data.draw(st.booleans(), label="truncate")
    if truncate and len(ids) > 1:
        ids = ids[: data.draw(st.integers(min_value=1, max_value=len(ids) - 1), label="max_tokens")]
    cuts = data.draw(st.lists(st.integers(min_value=1, max_value=max(1, len(ids) - 1)), max_size=12), label="cuts")
    fields = {"tool_choice": case["tool_choice"]}

    full = harness.parse_full(ids, fields, case["thinking"])
    streamed = harness.parse_stream(ids, cuts, fields, case["thinking"])
    by_token = harness.parse_stream(ids, range(1, len(ids)), fields, case["thinking"])
    assert _normalized(streamed) == _normalized(full)
    assert _normalized(by_token) == _normalized(full)
    assert streamed.issues == by_token.issues == full.issues

    if truncate:
        return
    assert full.reasoning == case["reasoning"]
    if case["tool_choice"] == "none":
        assert full.calls == [] and full.issues == []
        for name, rendered, _ in case["calls"]:
            assert written(name, rendered) in (full.content or "")
    else:
        kept = [(name, arguments) for name, _, arguments in case["calls"] if arguments is not None]
        assert [name for name, _ in full.calls] == [name for name, _ in kept]
        for index, (_, expected) in enumerate(kept):
            assert full.arguments(index) == expected
        assert full.indices == list(range(len(kept)))
        assert full.issues == expected_issues(case["calls"])


@pytest.mark.parametrize("thinking", [True, False])
def test_whole_parallel_calls_in_one_delta(harness: Qwen38Harness, thinking: bool) -> None:
    """Several complete calls arriving in one chunk (large MTP/spec-decode steps) all survive."""
    bodies = [
        ("get_weather", {"city": "Paris", "days": "3"}),
        ("write_file", {"path": "a.txt", "content": "x </function> y"}),
        ("get_weather", {"city": "Rome", "days": "1"}),
    ]
    text = ("ok\n</think>\n\n" if thinking else "") + "\n".join(render_call(n, a) for n, a in bodies)
    ids = harness.encode(text)
    one_chunk = harness.parse_stream(ids, [], {"tool_choice": "auto"}, thinking)
    assert [name for name, _ in one_chunk.calls] == ["get_weather", "write_file", "get_weather"]
    assert one_chunk.arguments(1) == {"path": "a.txt", "content": "x </function> y"}
    assert one_chunk.arguments(2) == {"city": "Rome", "days": 1}
    # Two chunks, the cut inside the second call.
    second = text.index("<function=write_file>") + 8
    cut = len(harness.encode(text[:second]))
    two_chunks = harness.parse_stream(ids, [cut], {"tool_choice": "auto"}, thinking)
    assert two_chunks.calls == one_chunk.calls
