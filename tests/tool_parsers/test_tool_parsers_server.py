"""qwen38 / qwen38_coder and Qwen38Middleware through stock vLLM's OpenAI server on CPU.

One server for the module, started with the flags the README documents. The tiny
model is random, so requests are greedy and the tool-call grammar (strict tools,
xgrammar structural tags) or `structured_outputs` decides what it writes; a logit
bias against whitespace-only tokens keeps it from filling the grammar's whitespace
slack until max_tokens. Every case compares the streamed response, joined, with
the non-streamed one.

Run with the shared lock: `flock /tmp/qwen38-vllm.lock .venv/bin/pytest tests/tool_parsers/test_tool_parsers_server.py`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

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


@pytest.fixture(scope="module")
def server(start_server: Any, tiny_checkpoint: Any) -> Any:
    return start_server(tiny_checkpoint("qwen3"), SERVER_ARGS)


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
    """One chat completion, streamed or not, as (reasoning, content, calls, finish_reason)."""
    base: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    base.update(request)
    if not stream:
        choice = client.chat.completions.create(**base).choices[0]
        message = choice.message
        return {
            "reasoning": (message.model_extra or {}).get("reasoning") or None,
            "content": message.content or None,
            "calls": [(call.function.name, call.function.arguments) for call in message.tool_calls or []],
            "finish": choice.finish_reason,
        }
    reasoning, content, finish = "", "", None
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **base):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, ["", ""])
            slot[0] += (call.function.name or "") if call.function else ""
            slot[1] += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return {
        "reasoning": reasoning or None,
        "content": content or None,
        "calls": [(name, args) for _, (name, args) in sorted(calls.items())],
        "finish": finish,
    }


def both(client: openai.OpenAI, **request: Any) -> dict[str, Any]:
    full = chat(client, False, **request)
    assert chat(client, True, **request) == full
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


# Keep-alive and the request timeline


def sse_lines(server: Any, path: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(response.iter_lines())


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_streams_with_keep_alive_stay_well_formed(server: Any, path: str) -> None:
    if path == "/v1/responses":
        body: dict[str, Any] = {"model": "tiny", "input": "hi", "max_output_tokens": 8, "stream": True}
    else:
        request = messages_request(8)
        body = {**request, **request.pop("extra_body"), "stream": True}
    lines = sse_lines(server, path, body)
    assert all(line == "" or line.startswith(("event:", "data:", ": keep-alive")) for line in lines), lines
    data = [json.loads(line[5:]) for line in lines if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    last = data[-1]["type"]
    assert last == ("response.completed" if path == "/v1/responses" else "message_stop")


def test_request_timeline_is_logged(server: Any, client: openai.OpenAI) -> None:
    def timeline() -> list[str]:
        return [line for line in server.log().splitlines() if "request timeline POST /v1/chat/completions" in line]

    logged_before = len(timeline())
    chat(client, False, max_tokens=2)
    # The middleware writes the line when the response has ended, which can be just after the
    # client has read it: wait (bounded) for this request's line rather than take the last one.
    # (An earlier test's line may also land after `logged_before`; this request is the only 200.)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ok_lines = [line for line in timeline()[logged_before:] if " status=200 " in line]
        if ok_lines:
            break
        time.sleep(0.1)
    assert len(ok_lines) == 1, timeline()[logged_before:]
    line = ok_lines[0]
    assert "status=200 body=" in line and "first_byte=" in line and "total=" in line
    assert "first_byte=-" not in line
