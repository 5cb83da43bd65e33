"""qwen38 / qwen38_coder and Qwen38Middleware through stock vLLM's OpenAI server on CPU.

One server for the module, started with the flags the README documents. The tiny
model is random, so requests are greedy and the tool-call grammar (strict tools,
xgrammar structural tags) or `structured_outputs` decides what it writes; a logit
bias against whitespace-only tokens keeps it from filling the grammar's whitespace
slack until max_tokens. Outputs no grammar can produce (a `<tool_call>` inside the
reasoning, malformed or mistyped calls, closing tags inside values) are forced token
by token through the test-support logits processor in `forced_output.py`, loaded
with vLLM's own `--logits-processors` flag. Every case compares the streamed
response, joined, with the non-streamed one.

The server holds an engine core (`tests.engines.engine_cores`) while it runs.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.engines import engine_cores
from tests.registrations import assert_registered_in_every_process
from tests.tool_parsers.forced_output import CLASS_PATH, FORCED_IDS_KEY, SLEEP_KEY
from tests.tool_parsers.qwen38_harness import Qwen38Harness, render_call

ROOT = Path(__file__).resolve().parents[2]
STALL_SECONDS = 1
# The plugins this server loads (`VLLM_PLUGINS`): what it serves needs tool_parsers alone.
PLUGINS = ("qwen38_plugin", "tool_parsers")

SERVER_ARGS = [
    "--served-model-name",
    "tiny",
    "--max-model-len",
    "2048",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "qwen38_coder",
    "--reasoning-parser",
    "qwen38",
    "--middleware",
    "tool_parsers.middleware.Qwen38Middleware",
    "--sse-keep-alive-interval",
    "1",
    "--enforce-eager",
    "--enable-log-requests",
    "--logits-processors",
    CLASS_PATH,
]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "set_level",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"level": {"$ref": "#/$defs/Level"}, "loud": {"type": "boolean"}},
                "required": ["level", "loud"],
                "additionalProperties": False,
                "$defs": {"Level": {"type": "integer", "enum": [1, 2]}},
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "ping", "strict": True, "parameters": {"type": "object", "properties": {}}},
    },
]
NO_THINKING = {"enable_thinking": False}
THINKING = {"enable_thinking": True}


# Tools without `strict`: no grammar, so forced outputs reach the parser as written.
LOOSE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def server(start_server: Any, tiny_checkpoint: Any) -> Iterator[Any]:
    model = tiny_checkpoint("qwen3")
    with engine_cores():
        # The repository root (for the test-support logits processor) before any given path,
        # so a checkout that puts its own plugin sources on PYTHONPATH serves those.
        pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env = {
            "PYTHONPATH": pythonpath,
            "TOOL_PARSERS_STALL_SECONDS": str(STALL_SECONDS),
            "VLLM_PLUGINS": ",".join(PLUGINS),  # the others stay out: test_vllm_plugins_excludes_the_others
        }
        server = start_server(model, SERVER_ARGS, env=env)
        try:
            yield server
        finally:
            server.stop()


def forced(harness: Qwen38Harness, text: str, **extra: Any) -> dict[str, Any]:
    """`vllm_xargs` that make the engine write exactly `text` (then EOS)."""
    return {FORCED_IDS_KEY: harness.encode(text), **extra}


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def no_whitespace(qwen3_tokenizer: Any) -> dict[str, int]:
    """logit_bias against every ordinary token that decodes to whitespace only."""
    first_special = min(qwen3_tokenizer.all_special_ids)
    return {
        str(token_id): -100
        for token_id in qwen3_tokenizer.get_vocab().values()
        if token_id < first_special and not qwen3_tokenizer.decode([token_id]).strip()
    }


def chat(client: openai.OpenAI, stream: bool, **request: Any) -> dict[str, Any]:
    """One chat completion, streamed or not, as (reasoning, content, calls, finish_reason).

    A stream is joined by hand, the way clients do: each call at the position its index names.
    """
    base: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    base.update(request)
    if not stream:
        return chat_result(client.chat.completions.create(**base).choices[0])
    reasoning, content, finish = "", "", None
    calls: list[list[str]] = []
    for chunk in client.chat.completions.create(stream=True, **base):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            while len(calls) <= call.index:  # an index past the end leaves a hole: an empty call
                calls.append(["", ""])
            calls[call.index][0] += (call.function.name or "") if call.function else ""
            calls[call.index][1] += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return {
        "reasoning": reasoning or None,
        "content": content or None,
        "calls": [(name, args) for name, args in calls],
        "finish": finish,
    }


def chat_result(choice: Any) -> dict[str, Any]:
    message = choice.message
    return {
        "reasoning": (message.model_extra or {}).get("reasoning") or None,
        "content": message.content or None,
        "calls": [(call.function.name, call.function.arguments) for call in message.tool_calls or []],
        "finish": choice.finish_reason,
    }


def chat_by_stream_helper(client: openai.OpenAI, **request: Any) -> dict[str, Any]:
    """The completion the `openai` client's own stream helper assembles (`chat.completions.stream`)."""
    base: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    base.update(request)
    try:
        with client.chat.completions.stream(**base) as stream:
            return chat_result(stream.get_final_completion().choices[0])
    except openai.LengthFinishReasonError as error:
        # With `strict` tools the helper refuses to parse an output max_tokens cut; what it
        # assembled up to there is the whole stream all the same.
        return chat_result(error.completion.choices[0])


def both(client: openai.OpenAI, **request: Any) -> dict[str, Any]:
    """The non-streamed completion, checked equal to the stream joined by hand and by the client's helper."""
    full = chat(client, False, **request)
    assert chat(client, True, **request) == full
    assert chat_by_stream_helper(client, **request) == full
    return full


def assert_valid_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "set_level":
        # `level` is typed through $ref: an integer, not the string "1".
        assert args["level"] in (1, 2) and isinstance(args["level"], int)
        assert isinstance(args["loud"], bool)
    else:
        assert (name, args) == ("ping", {})


@pytest.mark.parametrize("parallel", [False, True, None])
@pytest.mark.parametrize("tool_choice", ["required", "set_level", "ping"])
def test_forced_calls(
    client: openai.OpenAI, no_whitespace: dict[str, int], tool_choice: str, parallel: bool | None
) -> None:
    named = tool_choice != "required"
    request: dict[str, Any] = {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": tool_choice}} if named else "required",
        "max_tokens": 120,
        "logit_bias": no_whitespace,
        "extra_body": {"chat_template_kwargs": NO_THINKING},
    }
    if parallel is not None:
        request["parallel_tool_calls"] = parallel
    result = both(client, **request)
    assert result["calls"], result
    if parallel is False:
        # Otherwise the grammar allows text after the first call, which the random model writes.
        assert not result["content"]
    for name, arguments in result["calls"]:
        assert name == tool_choice if named else name in ("set_level", "ping")
        assert_valid_call(name, arguments)
    if parallel is False:
        assert len(result["calls"]) == 1
    if result["finish"] != "length":
        assert result["finish"] == ("stop" if named else "tool_calls")


def test_required_call_stopped_before_it_parses_is_not_tool_calls(
    server: Any, client: openai.OpenAI, no_whitespace: dict[str, int]
) -> None:
    result = both(
        client,
        tools=TOOLS,
        tool_choice="required",
        stop=["<function"],
        max_tokens=40,
        logit_bias=no_whitespace,
        extra_body={"chat_template_kwargs": NO_THINKING},
    )
    assert result["calls"] == []
    assert result["finish"] == "stop"
    # vLLM itself said "tool_calls" here (non-streamed); the middleware corrected it.
    assert "finish_reason corrected: no parsed tool calls: stop" in server.log()


@pytest.mark.parametrize("thinking", [THINKING, NO_THINKING])
@pytest.mark.parametrize("tool_choice", ["auto", "required", "none"])
def test_unforced_outputs_agree(client: openai.OpenAI, thinking: dict[str, bool], tool_choice: str) -> None:
    # With thinking on, the grammar starts after the reasoning, which the random model
    # never ends within max_tokens: all of it is reasoning, and no call is reported.
    result = both(
        client, tools=TOOLS, tool_choice=tool_choice, max_tokens=24, extra_body={"chat_template_kwargs": thinking}
    )
    if thinking["enable_thinking"]:
        assert result["reasoning"] and not result["content"] and not result["calls"]
        assert result["finish"] == "length"
    else:
        assert result["reasoning"] is None


@pytest.mark.parametrize("parallel", [False, True, None])
def test_auto_call(client: openai.OpenAI, no_whitespace: dict[str, int], parallel: bool | None) -> None:
    # tool_choice=auto with structured outputs: the grammar is "a call or this text".
    request: dict[str, Any] = {
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 120,
        "logit_bias": no_whitespace,
        "extra_body": {
            "chat_template_kwargs": NO_THINKING,
            "structured_outputs": {"choice": ["<function=ping>\n</function>"]},
        },
    }
    if parallel is not None:
        request["parallel_tool_calls"] = parallel
    result = both(client, **request)
    assert result["calls"], result
    for name, arguments in result["calls"]:
        assert_valid_call(name, arguments)
    if parallel is False:
        assert len(result["calls"]) == 1
    assert result["finish"] in ("tool_calls", "length")


def test_tool_choice_none_returns_markup_verbatim(client: openai.OpenAI) -> None:
    call = "<function=set_level>\n<parameter=level>\n2\n</parameter>\n</function>"
    answer = "Sure. <tool_call>\n" + call + "\n</tool_call> if a <"
    result = both(
        client,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=80,
        extra_body={"chat_template_kwargs": NO_THINKING, "structured_outputs": {"choice": [answer]}},
    )
    assert result == {"reasoning": None, "content": answer, "calls": [], "finish": "stop"}


def test_undefined_ref_is_a_clear_400(client: openai.OpenAI) -> None:
    broken = {"name": "broken", "strict": True, "parameters": {"properties": {"x": {"$ref": "#/$defs/X"}}}}
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, False, tools=[{"type": "function", "function": broken}], tool_choice="required", max_tokens=8)
    assert "tools[0] ('broken')" in str(error.value) and "$defs" in str(error.value)


# Anthropic /v1/messages


def messages_request(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
            for t in TOOLS
            if t["function"]["name"] == "set_level"
        ],
        "tool_choice": {"type": "tool", "name": "set_level"},
        "extra_body": {"temperature": 0, "chat_template_kwargs": NO_THINKING},
    }


def test_messages_forced_call_cut_by_max_tokens_is_left_out(server: Any) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    message = client.messages.create(**messages_request(24))
    assert message.stop_reason == "max_tokens"
    assert [block.type for block in message.content if block.type == "tool_use"] == []

    with client.messages.stream(**messages_request(24)) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert not any(
        e.type == "content_block_start" and getattr(e.content_block, "type", "") == "tool_use" for e in events
    )
    # vLLM produced the tool_use blocks; the middleware left them out, and says so.
    assert server.log().count("/v1/messages: left out tool calls cut short: set_level") >= 2


# R01: a <tool_call> written inside the reasoning ends it (forced: no grammar applies there)


@pytest.mark.parametrize(
    "answer_format",
    [
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
            }
        },
    ],
)
def test_tool_call_marker_in_reasoning_leaves_a_json_answer(
    client: openai.OpenAI, harness: Qwen38Harness, answer_format: dict[str, Any]
) -> None:
    # The JSON grammar starts after the marker; stock vLLM fed the marker to the grammar,
    # which rejected it, and the request ended with an internal error (HTTP 500).
    answer = '{"a": 1}'
    result = both(
        client,
        max_tokens=40,
        extra_body={
            "chat_template_kwargs": THINKING,
            "vllm_xargs": forced(harness, "Think first.<tool_call>" + answer),
        },
        **answer_format,
    )
    assert result == {"reasoning": "Think first.", "content": answer, "calls": [], "finish": "stop"}


def test_tool_call_marker_in_reasoning_starts_the_call(client: openai.OpenAI, harness: Qwen38Harness) -> None:
    call = render_call("get_weather", {"city": "Paris", "days": "3"})
    result = both(
        client,
        tools=LOOSE_TOOLS,
        max_tokens=60,
        extra_body={"chat_template_kwargs": THINKING, "vllm_xargs": forced(harness, "Think first." + call)},
    )
    assert result == {
        "reasoning": "Think first.",
        "content": None,
        "calls": [("get_weather", json.dumps({"city": "Paris", "days": 3}))],
        "finish": "tool_calls",
    }


# Values that contain the closing tags


def test_value_containing_the_terminator_sequence_is_kept_whole(client: openai.OpenAI, harness: Qwen38Harness) -> None:
    city = "a</parameter>\n</function>\nb"
    text = render_call("get_weather", {"city": city, "days": "2"})
    result = both(
        client,
        tools=LOOSE_TOOLS,
        max_tokens=80,
        extra_body={"chat_template_kwargs": NO_THINKING, "vllm_xargs": forced(harness, text)},
    )
    assert [(name, json.loads(args)) for name, args in result["calls"]] == [("get_weather", {"city": city, "days": 2})]


# Bad input: the response keeps what is valid and says what was dropped (tool_call_issues)

BAD_OUTPUTS: dict[str, tuple[str, int]] = {
    # name: (forced output, max_tokens)
    "malformed": ("Sure. <tool_call>\nhello\n</tool_call>", 60),
    "unknown_function": (
        render_call("delete_everything", {"path": "/"}) + "\n" + render_call("get_weather", {"city": "Paris"}),
        80,
    ),
    "type_mismatch": (render_call("get_weather", {"city": "Oslo", "days": "a week"}), 80),
    # Cut by max_tokens inside the city value.
    "cut_short": (render_call("get_weather", {"days": "3", "city": "Rome and many more words here"}), 0),
}


def bad_output(harness: Qwen38Harness, case: str) -> tuple[dict[str, Any], int]:
    text, max_tokens = BAD_OUTPUTS[case]
    if case == "cut_short":
        max_tokens = len(harness.encode(text[: text.index("many")]))
    return forced(harness, text), max_tokens


def expected_issue(case: str, api: str) -> dict[str, Any]:
    """The one issue each bad output gives; `/v1/messages` leaves a call cut short out."""
    if case == "malformed":
        return {"issue": "malformed", "action": "dropped_call", "index": 0, "name": None}
    if case == "unknown_function":
        return {"issue": "unknown_function", "action": "dropped_call", "index": 0, "name": "delete_everything"}
    if case == "type_mismatch":
        return {
            "issue": "type_mismatch",
            "action": "dropped_argument",
            "name": "get_weather",
            "argument": "days",
            "expected": ["integer"],
            "value": "a week",
        }
    action = "dropped_call" if api == "messages" else "kept_incomplete"
    return {"issue": "cut_short", "action": action, "index": 0, "name": "get_weather"}


def check_issues(issues: Any, case: str, api: str) -> None:
    assert isinstance(issues, list) and len(issues) == 1, issues
    expected = expected_issue(case, api)
    assert {key: issues[0].get(key) for key in expected} == expected


def expected_calls(case: str) -> list[tuple[str, dict[str, Any]]]:
    """What stays valid of each bad output."""
    if case == "unknown_function":
        return [("get_weather", {"city": "Paris"})]
    if case == "type_mismatch":
        return [("get_weather", {"city": "Oslo"})]
    return []


@pytest.mark.parametrize("case", list(BAD_OUTPUTS))
def test_chat_says_what_was_dropped(client: openai.OpenAI, harness: Qwen38Harness, case: str) -> None:
    xargs, max_tokens = bad_output(harness, case)
    request: dict[str, Any] = {
        "tools": LOOSE_TOOLS,
        "max_tokens": max_tokens,
        "extra_body": {"chat_template_kwargs": NO_THINKING, "vllm_xargs": xargs},
    }
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], **request
    )
    completion = raw.parse()
    issues = (completion.model_extra or {}).get("tool_call_issues")
    check_issues(issues, case, "chat")
    assert raw.headers["x-tool-call-issues"].startswith(f"{case}:")
    message = completion.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    if case == "cut_short":
        # Kept (incomplete, with what it has), and the finish reason says the output was cut.
        ((name, args),) = calls
        assert name == "get_weather" and args["days"] == 3
        assert args["city"].startswith("Rome and") and "Rome and many more words here".startswith(args["city"])
        assert completion.choices[0].finish_reason == "length"
    else:
        assert calls == expected_calls(case)
    assert "<tool_call>" not in (message.content or "")
    assert strip_ids(chat_stream_issues(client, **request)) == strip_ids(issues)
    both(client, **request)


def chat_stream_issues(client: openai.OpenAI, **request: Any) -> Any:
    """`tool_call_issues` of a streamed chat completion (its last chunk before `[DONE]`)."""
    issues = None
    for chunk in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, **request
    ):
        issues = (chunk.model_extra or {}).get("tool_call_issues", issues)
    return issues


@pytest.mark.parametrize("case", list(BAD_OUTPUTS))
def test_responses_say_what_was_dropped(server: Any, client: openai.OpenAI, harness: Qwen38Harness, case: str) -> None:
    xargs, max_tokens = bad_output(harness, case)
    body = {
        "model": "tiny",
        "input": "hi",
        "tools": [{"type": "function", **LOOSE_TOOLS[0]["function"]}],
        "max_output_tokens": max_tokens,
        "chat_template_kwargs": NO_THINKING,
        "vllm_xargs": xargs,
    }
    response = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=120)
    assert response.status_code == 200
    full = response.json()
    check_issues(full["tool_call_issues"], case, "responses")
    assert response.headers["x-tool-call-issues"].startswith(f"{case}:")
    calls = [
        (item["name"], json.loads(item["arguments"])) for item in full["output"] if item["type"] == "function_call"
    ]
    if case != "cut_short":
        assert calls == expected_calls(case)
    final = responses_both(server, client, body, full)
    assert final["type"] in ("response.completed", "response.incomplete")
    assert strip_ids(final["response"]["tool_call_issues"]) == strip_ids(full["tool_call_issues"])
    assert strip_ids(final["response"]["output"]) == strip_ids(full["output"])


@pytest.mark.parametrize("case", list(BAD_OUTPUTS))
def test_messages_say_what_was_dropped(server: Any, harness: Qwen38Harness, case: str) -> None:
    xargs, max_tokens = bad_output(harness, case)
    request: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "get_weather", "input_schema": LOOSE_TOOLS[0]["function"]["parameters"]}],
        "extra_body": {"chat_template_kwargs": NO_THINKING, "vllm_xargs": xargs},
    }
    message, events = messages_both(server, request)
    issues = (message.model_extra or {}).get("tool_call_issues")
    check_issues(issues, case, "messages")
    calls = [(block.name, block.input) for block in message.content if block.type == "tool_use"]
    assert calls == expected_calls(case)
    if case == "cut_short":
        assert message.stop_reason == "max_tokens"
    deltas = [e for e in events if e.type == "message_delta"]
    assert strip_ids((deltas[-1].model_extra or {}).get("tool_call_issues")) == strip_ids(issues)


# Calls after dropped ones: streamed indices count the calls sent, as clients fill their arrays by them

DROPPED_AROUND = "\n".join(
    [
        render_call("delete_everything", {"path": "/"}),
        render_call("get_weather", {"city": "Paris"}),
        "<tool_call>\nhello\n</tool_call>",
        render_call("get_weather", {"city": "Rome", "days": "2"}),
    ]
)
KEPT_AROUND = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]
# `index` of an issue counts every call the model wrote.
ISSUES_AROUND = [
    {"issue": "unknown_function", "action": "dropped_call", "index": 0, "name": "delete_everything"},
    {"issue": "malformed", "action": "dropped_call", "index": 2, "name": None},
]


def check_issues_around(issues: Any) -> None:
    assert [{key: issue.get(key) for key in ISSUES_AROUND[0]} for issue in issues] == ISSUES_AROUND


# (Only with parallel calls allowed: with parallel_tool_calls=false vLLM constrains the calls by a
# grammar, which rejects the forced call to an unknown function.)


def test_chat_calls_after_dropped_ones(client: openai.OpenAI, harness: Qwen38Harness) -> None:
    request: dict[str, Any] = {
        "tools": LOOSE_TOOLS,
        "max_tokens": 120,
        "extra_body": {"chat_template_kwargs": NO_THINKING, "vllm_xargs": forced(harness, DROPPED_AROUND)},
    }
    result = both(client, **request)
    assert [(name, json.loads(args)) for name, args in result["calls"]] == KEPT_AROUND
    check_issues_around(chat_stream_issues(client, **request))


def test_responses_calls_after_dropped_ones(server: Any, client: openai.OpenAI, harness: Qwen38Harness) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "input": "hi",
        "tools": [{"type": "function", **LOOSE_TOOLS[0]["function"]}],
        "max_output_tokens": 120,
        "chat_template_kwargs": NO_THINKING,
        "vllm_xargs": forced(harness, DROPPED_AROUND),
    }
    full = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=120).json()
    calls = [(i["name"], json.loads(i["arguments"])) for i in full["output"] if i["type"] == "function_call"]
    assert calls == KEPT_AROUND
    final = responses_both(server, client, body, full)
    check_issues_around(final["response"]["tool_call_issues"])


def test_messages_calls_after_dropped_ones(server: Any, harness: Qwen38Harness) -> None:
    request: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 120,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "get_weather", "input_schema": LOOSE_TOOLS[0]["function"]["parameters"]}],
        "extra_body": {"chat_template_kwargs": NO_THINKING, "vllm_xargs": forced(harness, DROPPED_AROUND)},
    }
    message, _ = messages_both(server, request)
    calls = [(block.name, block.input) for block in message.content if block.type == "tool_use"]
    assert calls == KEPT_AROUND
    check_issues_around((message.model_extra or {}).get("tool_call_issues"))


def strip_ids(value: Any) -> Any:
    """`value` without the random ids the server gives items and calls, and without item
    `status` (stock vLLM leaves it null on non-streamed reasoning items, "completed" when streamed)."""
    if isinstance(value, list):
        return [strip_ids(item) for item in value]
    if isinstance(value, dict):
        return {k: strip_ids(v) for k, v in value.items() if k not in ("id", "call_id", "status")}
    return value


def responses_stream(server: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    lines = sse_lines(server, "/v1/responses", {**body, "stream": True})
    return [json.loads(line[5:]) for line in lines if line.startswith("data:")]


def output_items(output: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What a Responses `output` says: each item's type and text, or function name and arguments."""
    items: list[tuple[Any, ...]] = []
    for item in output:
        if item["type"] == "function_call":
            items.append(("function_call", item["name"], json.loads(item["arguments"] or "{}")))
        else:
            items.append((item["type"], "".join(part.get("text") or "" for part in item.get("content") or [])))
    return items


def responses_both(server: Any, client: openai.OpenAI, body: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    """Stream `body` twice: its events joined by hand (each item at its `output_index`) and by the
    `openai` client's `responses.stream` helper both give the non-streamed `full` output. Returns the
    final event of the raw stream."""
    events = responses_stream(server, body)
    joined: list[dict[str, Any]] = []
    for event in events:
        index = event.get("output_index")
        if event["type"] == "response.output_item.added":
            while len(joined) <= index:  # an index past the end leaves a hole
                joined.append({"type": "hole"})
            item = event["item"]
            joined[index] = {**item, "arguments": "", "content": [{"text": ""}]}
        elif event["type"] == "response.function_call_arguments.delta":
            joined[index]["arguments"] += event["delta"]
        elif event["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            joined[index]["content"][0]["text"] += event["delta"]
    assert output_items(joined) == output_items(full["output"])

    known = ("model", "input", "tools", "max_output_tokens", "parallel_tool_calls")
    with client.responses.stream(
        **{key: body[key] for key in known if key in body},
        extra_body={key: value for key, value in body.items() if key not in known},
    ) as stream:
        assembled = [e.response for e in stream if e.type in ("response.completed", "response.incomplete")]
    assert output_items(assembled[-1].model_dump(mode="json")["output"]) == output_items(full["output"])
    return events[-1]


def messages_both(server: Any, request: dict[str, Any]) -> tuple[Any, list[Any]]:
    """The non-streamed message, checked against its stream joined by hand (each block at its
    `index`) and by the `anthropic` client's `messages.stream` helper; and the stream's events.

    An empty text block is left out of the comparison: vLLM gives an empty non-streamed message
    one (Anthropic's canonical shape), and its stream none."""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    message = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    joined: list[list[Any]] = []  # [type, name, text or partial JSON]
    for event in events:
        if event.type == "content_block_start":
            while len(joined) <= event.index:  # an index past the end leaves a hole
                joined.append(["hole", None, ""])
            block = event.content_block
            joined[event.index] = [block.type, getattr(block, "name", None), ""]
        elif event.type == "content_block_delta":
            delta = event.delta
            for field in ("partial_json", "text", "thinking"):
                joined[event.index][2] += getattr(delta, field, None) or ""

    def blocks(content: list[Any]) -> list[tuple[Any, ...]]:
        return [
            ("tool_use", b.name, b.input)
            if b.type == "tool_use"
            else (b.type, getattr(b, "text", getattr(b, "thinking", "")))
            for b in content
            if not (b.type == "text" and not b.text)
        ]

    by_hand = [
        (kind, name, json.loads(text or "{}")) if kind == "tool_use" else (kind, text)
        for kind, name, text in joined
        if not (kind == "text" and not text)
    ]
    assert by_hand == blocks(final.content) == blocks(message.content)
    return message, events


# Responses API: reasoning and tool calls, streamed and not


def test_responses_reasoning_and_parallel_calls(server: Any, client: openai.OpenAI, harness: Qwen38Harness) -> None:
    calls = [("get_weather", {"city": "Paris", "days": "3"}), ("get_weather", {"city": "Rome", "days": "1"})]
    text = "Hmm, two cities.\n</think>\n\nChecking.\n" + "\n".join(render_call(n, a) for n, a in calls)
    body = {
        "model": "tiny",
        "input": "hi",
        "tools": [{"type": "function", **LOOSE_TOOLS[0]["function"]}],
        "max_output_tokens": 120,
        "chat_template_kwargs": THINKING,
        "vllm_xargs": forced(harness, text),
    }
    full = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=120).json()
    kinds = [item["type"] for item in full["output"]]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    assert full["output"][0]["content"][0]["text"] == "Hmm, two cities.\n"
    assert full["output"][1]["content"][0]["text"].strip() == "Checking."
    parsed = [(item["name"], json.loads(item["arguments"])) for item in full["output"][2:]]
    assert parsed == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome", "days": 1})]
    assert "tool_call_issues" not in full

    # The deltas, joined by hand and by the openai client's helper, give the same items.
    final = responses_both(server, client, body, full)
    assert strip_ids(final["response"]["output"]) == strip_ids(full["output"])


# Keep-alive, the request log and stalled requests


def sse_lines(server: Any, path: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(response.iter_lines())


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_idle_streams_get_keep_alive_comments(server: Any, harness: Qwen38Harness, path: str) -> None:
    # The engine stalls 1.5 s before each of its 3 steps; the interval is 1 s.
    xargs = forced(harness, "a b", **{SLEEP_KEY: 1.5})
    if path == "/v1/responses":
        body: dict[str, Any] = {"model": "tiny", "input": "hi", "max_output_tokens": 8, "stream": True}
    else:
        request = messages_request(8)
        extra = request.pop("extra_body")  # merged into the body, not sent as a field of its own
        body = {**request, **extra, "stream": True}
        body.pop("tool_choice"), body.pop("tools")
    lines = sse_lines(server, path, {**body, "vllm_xargs": xargs})
    assert all(line == "" or line.startswith(("event:", "data:", ": keep-alive")) for line in lines), lines
    data = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    assert data[-1]["type"] == ("response.completed" if path == "/v1/responses" else "message_stop")
    # Comments between events, while the engine was stalled between tokens.
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    last_data = max(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert any(line == ": keep-alive" for line in lines[first_data:last_data])
    if path == "/v1/responses":
        kinds = ("response.reasoning_text.delta", "response.output_text.delta")
        text = "".join(d["delta"] for d in data if d["type"] in kinds)
    else:
        deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
        text = "".join(d.get("text", "") or d.get("thinking", "") for d in deltas)
    assert text.strip() == "a b"


def test_request_log_reports_http_spans(server: Any, client: openai.OpenAI) -> None:
    def logged(request_id: str) -> list[str]:
        return [line for line in server.log().splitlines() if f"Received request {request_id}" in line]

    completion = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    # vLLM's own `--enable-log-requests` line carries both HTTP spans.
    (line,) = logged(completion.id)
    spans = re.search(r"http_receipt_to_body_end=([0-9.]+)ms body_end_to_now=([0-9.]+)ms", line)
    assert spans is not None, line
    # And the middleware's own line, written when the response has ended.
    deadline = time.monotonic() + 10
    ok_lines: list[str] = []
    while time.monotonic() < deadline and not ok_lines:
        ok_lines = [
            entry
            for entry in server.log().splitlines()
            if "request timeline POST /v1/chat/completions status=200" in entry
        ]
        time.sleep(0.1)
    assert ok_lines and "first_byte=-" not in ok_lines[-1]


def test_stalled_request_is_logged_while_it_waits(server: Any, harness: Qwen38Harness) -> None:
    # The engine stalls 0.8 s per step (4 steps) before this non-streamed response
    # starts; the server's stall threshold is TOOL_PARSERS_STALL_SECONDS=1. (A request
    # that then ends without any response is logged too: the ASGI-level test.)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "stall"}],
        "max_tokens": 4,
        "vllm_xargs": forced(harness, "a b c", **{SLEEP_KEY: 0.8}),
    }
    logged_before = len(server.log())
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200
    log = server.log()[logged_before:]
    assert f"POST /v1/chat/completions: no response {STALL_SECONDS} s after receipt (body read)" in log


def test_vllm_plugins_excludes_the_others(server: Any, client: openai.OpenAI) -> None:
    # Every test of this module is served with only the plugins VLLM_PLUGINS names; each of them
    # registers in the API server, the engine core and the worker, and none of the other three does.
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0.0,
        extra_body={"chat_template_kwargs": NO_THINKING},
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"
    assert_registered_in_every_process(server, PLUGINS)
