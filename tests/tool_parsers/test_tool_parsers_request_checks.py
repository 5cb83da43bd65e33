"""tool_parsers.request_checks: the checks on real request bodies, and the ASGI layer (no server).

The served behaviour (stock vLLM behind the middleware, each bad request answered and the
server going on) is tested in tests/soak/test_soak.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tool_parsers.middleware import Qwen38Middleware
from tool_parsers.request_checks import (
    BODY_TIMEOUT_ENV,
    MAX_N_ENV,
    UNKNOWN_FIELDS_ENV,
    CheckSettings,
    RequestChecksMiddleware,
    check_request,
    ref_cycle_problem,
)

Message = dict[str, Any]
SETTINGS = CheckSettings()
USER = [{"role": "user", "content": "hi"}]
TREE = {
    "type": "object",
    "properties": {"root": {"$ref": "#/$defs/Node"}},
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
            },
            "required": ["value"],
        }
    },
}


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": USER, **fields}).encode()


def tools(schema: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": schema}}]


# ── the checks ──────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", chat(max_tokens=8, temperature=0, n=16, tools=tools(TREE), tool_choice="auto")),
        ("/v1/chat/completions", chat(return_token_ids=True, vllm_xargs={"a": 1}, chat_template_kwargs={})),
        ("/v1/completions", json.dumps({"model": "m", "prompt": [1, 2], "n": 2, "cache_salt": "x"}).encode()),
        ("/v1/messages", json.dumps({"model": "m", "max_tokens": 4, "messages": USER, "metadata": {}}).encode()),
        ("/v1/responses", json.dumps({"model": "m", "input": "hi", "max_output_tokens": 4}).encode()),
        # malformed JSON and non-objects are left to vLLM, which answers them with 400 itself
        ("/v1/chat/completions", b'{"model": "m", "messages": ['),
        ("/v1/chat/completions", b"[1, 2]"),
    ],
)
def test_good_requests_and_what_vllm_answers_itself_pass(path: str, body: bytes) -> None:
    assert check_request(path, body, SETTINGS) is None


def test_a_field_only_the_upstream_api_defines_passes_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.tool_parsers.checks"):
        assert check_request("/v1/chat/completions", chat(store=True, prompt_cache_key="k"), SETTINGS) is None
    assert "ignoring field(s) this server does not implement: prompt_cache_key, store" in caplog.text


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/v1/chat/completions", chat(max_tokenz=3), "max_tokenz", ["unknown field 'max_tokenz'"]),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "a": 1, "b": 2}', "a", ["unknown fields 'a', 'b'"]),
        ("/v1/messages", b'{"model": "m", "max_tokens": 1, "messages": [], "n": 2}', "n", ["unknown field 'n'"]),
        ("/v1/chat/completions", chat(n=17), "n", ["n: 17", "limit of 16", MAX_N_ENV]),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "n": 16384}', "n", ["n: 16384"]),
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": "a@@"}]).replace(b"@@", b"\xff"),
            "messages[0].content",
            ["not valid UTF-8", "byte 0xff"],
        ),
        ("/v1/chat/completions", b'{"model": "m", "messages": [], "\xc3": 1}', "body", ["not valid UTF-8"]),
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": "a\udfffb"}]),
            "messages[0].content",
            ["lone UTF-16 surrogate \\udfff"],
        ),
        (
            "/v1/chat/completions",
            chat(tools=tools({"type": "object", "properties": [1]}), tool_choice="required"),
            "tools[0].function.parameters",
            ["tools[0].function.parameters ('f') is not a valid JSON Schema", "(at properties)"],
        ),
        (
            "/v1/chat/completions",
            chat(tools=tools({"type": "nonsense"})),
            "tools[0].function.parameters",
            ["'nonsense'", "(at type)"],
        ),
        (
            "/v1/chat/completions",
            chat(tools=tools({"properties": {"x": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"$ref": "#/$defs/A"}}})),
            "tools[0].function.parameters",
            ["$ref '#/$defs/A' -> '#/$defs/A' never reaches a type"],
        ),
        (
            "/v1/messages",
            json.dumps(
                {"model": "m", "max_tokens": 1, "messages": [], "tools": [{"name": "t", "input_schema": {"$ref": "#"}}]}
            ).encode(),
            "tools[0].input_schema",
            ["tools[0].input_schema ('t')", "$ref '#' -> '#'"],
        ),
        (
            "/v1/responses",
            json.dumps(
                {"model": "m", "input": "x", "tools": [{"type": "function", "name": "t", "parameters": {"type": 3}}]}
            ).encode(),
            "tools[0].parameters",
            ["tools[0].parameters ('t') is not a valid JSON Schema"],
        ),
        (
            "/v1/messages",
            json.dumps(
                {
                    "model": "m",
                    "max_tokens": 1,
                    "messages": [],
                    "tools": [{"name": "t", "input_schema": {"type": "object"}}],
                    "tool_choice": {"type": "tool", "name": "u"},
                }
            ).encode(),
            "tool_choice",
            ["tool_choice.name: 'u' is not among the request's tools (tools: 't')"],
        ),
    ],
)
def test_bad_requests_are_answered_naming_the_field(path: str, body: bytes, param: str, words: list[str]) -> None:
    failure = check_request(path, body, SETTINGS)
    assert failure is not None
    assert (failure.status, failure.param) == (400, param)
    for word in words:
        assert word in failure.message


@pytest.mark.parametrize(
    "schema, problem",
    [
        (TREE, None),
        # a base case through anyOf
        ({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "string"}]}}, "$ref": "#/$defs/A"}, None),
        # an optional self-reference: the property may be left out
        (
            {"$defs": {"L": {"type": "object", "properties": {"next": {"$ref": "#/$defs/L"}}}}, "$ref": "#/$defs/L"},
            None,
        ),
        # references that point nowhere are the parser's to report (HTTP 400 naming the tool)
        ({"properties": {"x": {"$ref": "#/$defs/Missing"}}}, None),
        (
            {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
            "'#/$defs/A' -> '#/$defs/B' -> '#/$defs/A'",
        ),
        ({"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}, {"type": "string"}]}}, "$ref": "#/$defs/A"}, "'#/$defs/A'"),
        ({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"}, "'#/$defs/A'"),
        # every node requires a next one, or a non-empty list of them: no finite value
        (
            {
                "$defs": {"L": {"type": "object", "properties": {"n": {"$ref": "#/$defs/L"}}, "required": ["n"]}},
                "$ref": "#/$defs/L",
            },
            "'#/$defs/L'",
        ),
        (
            {"$defs": {"T": {"type": "array", "items": {"$ref": "#/$defs/T"}, "minItems": 1}}, "$ref": "#/$defs/T"},
            "'#/$defs/T'",
        ),
        # an unused definition that cycles is still an unusable schema
        (
            {"type": "object", "$defs": {"A": {"$ref": "#/$defs/A"}}, "properties": {"a": {"$ref": "#/$defs/A"}}},
            "'#/$defs/A'",
        ),
    ],
)
def test_ref_cycles_without_a_base_case(schema: dict[str, Any], problem: str | None) -> None:
    found = ref_cycle_problem(schema)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found and "never reaches a type" in found


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CheckSettings.from_env() == CheckSettings(16, 30.0, "reject")
    monkeypatch.setenv(MAX_N_ENV, "4")
    monkeypatch.setenv(BODY_TIMEOUT_ENV, "2.5")
    monkeypatch.setenv(UNKNOWN_FIELDS_ENV, "warn")
    assert CheckSettings.from_env() == CheckSettings(4, 2.5, "warn")
    assert check_request("/v1/chat/completions", chat(n=5, extra=1), CheckSettings.from_env()).param == "n"  # type: ignore[union-attr]
    assert check_request("/v1/chat/completions", chat(n=4, extra=1), CheckSettings.from_env()) is None
    for name, value, message in [
        (MAX_N_ENV, "many", "is not a whole number"),
        (MAX_N_ENV, "0", "must be positive"),
        (BODY_TIMEOUT_ENV, "-1", "must be positive"),
        (UNKNOWN_FIELDS_ENV, "drop", "use one of reject, warn"),
    ]:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=message):
            CheckSettings.from_env()
        monkeypatch.delenv(name)


# ── the ASGI layer ──────────────────────────────────────────────────────────


def recording_app(calls: list[bytes]) -> Callable[[Any, Any, Any], Awaitable[None]]:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        calls.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    return app


def drive(app: Any, path: str, chunks: list[Message], method: str = "POST", hang: bool = False) -> list[Message]:
    sent: list[Message] = []
    scope = {"type": "http", "method": method, "path": path, "headers": [(b"content-length", b"999")]}

    async def receive() -> Message:
        if chunks:
            return chunks.pop(0)
        if hang:
            await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def body_chunks(raw: bytes, pieces: int = 3) -> list[Message]:
    size = max(1, len(raw) // pieces)
    parts = [raw[i : i + size] for i in range(0, len(raw), size)]
    return [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]


def test_a_good_body_reaches_vllm_unchanged() -> None:
    calls: list[bytes] = []
    raw = chat(max_tokens=3)
    sent = drive(RequestChecksMiddleware(recording_app(calls)), "/v1/chat/completions", body_chunks(raw))
    assert calls == [raw]
    assert sent[0]["status"] == 200


@pytest.mark.parametrize(
    "path, expected",
    [
        ("/v1/chat/completions", {"error": {"type": "BadRequestError", "param": "n", "code": 400}}),
        ("/v1/messages", {"type": "error", "error": {"type": "BadRequestError"}}),
    ],
)
def test_a_bad_body_is_answered_in_the_endpoints_error_shape(path: str, expected: dict[str, Any]) -> None:
    calls: list[bytes] = []
    raw = (
        chat(n=99)
        if path != "/v1/messages"
        else json.dumps({"model": "m", "max_tokens": 1, "messages": [], "x": 1}).encode()
    )
    sent = drive(Qwen38Middleware(recording_app(calls)), path, body_chunks(raw))
    assert calls == []
    assert sent[0]["status"] == 400
    answer = json.loads(sent[1]["body"])
    for key, value in expected.items():
        assert answer[key] == value if not isinstance(value, dict) else value.items() <= answer[key].items()
    assert "message" in (answer["error"])


def test_a_body_that_stops_arriving_is_answered_408(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[bytes] = []
    app = RequestChecksMiddleware(recording_app(calls), CheckSettings(body_timeout=0.2))
    half = [{"type": "http.request", "body": chat()[:10], "more_body": True}]
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.tool_parsers.checks"):
        sent = drive(app, "/v1/chat/completions", half, hang=True)
    assert calls == []
    assert sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"]
    message = json.loads(sent[1]["body"])["error"]["message"]
    assert message == (
        "body: incomplete request body (10 of 999 bytes) and nothing more for 0.2 s (TOOL_PARSERS_BODY_TIMEOUT_SECONDS)"
    )
    assert "answered 408" in caplog.text


def test_a_body_sent_while_the_server_loop_was_stalled_is_read_not_answered_408() -> None:
    """The event loop blocks for three timeouts (a long tokenization, a garbage collection) and
    the body arrives just after: the client was never silent for the timeout, so the request
    goes on. (`asyncio.wait_for` answered 408 here: its timer fired on the stall's first tick.)"""
    calls: list[bytes] = []
    timeout = 0.2
    raw = chat(max_tokens=3)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    sent: list[Message] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()

        async def receive() -> Message:
            await arrived.wait()
            return {"type": "http.request", "body": raw, "more_body": False}

        async def send(message: Message) -> None:
            sent.append(message)

        def stall_then_send() -> None:
            time.sleep(3 * timeout)  # the loop does nothing else meanwhile
            loop.call_later(0.05, arrived.set)  # the body comes 50 ms after the stall

        loop.call_later(0.05, stall_then_send)
        app = RequestChecksMiddleware(recording_app(calls), CheckSettings(body_timeout=timeout))
        await app(scope, receive, send)

    asyncio.run(main())
    assert sent[0]["status"] == 200
    assert calls == [raw]


def test_a_client_gone_before_its_body_ended_gets_nothing() -> None:
    calls: list[bytes] = []
    half = [{"type": "http.request", "body": b'{"model"', "more_body": True}]
    assert drive(RequestChecksMiddleware(recording_app(calls)), "/v1/completions", half) == []
    assert calls == []


@pytest.mark.parametrize(
    "method, path", [("GET", "/v1/models"), ("POST", "/tokenize"), ("GET", "/v1/chat/completions")]
)
def test_other_requests_are_not_touched(method: str, path: str) -> None:
    calls: list[bytes] = []
    raw = b"\xff not even json"
    sent = drive(RequestChecksMiddleware(recording_app(calls)), path, body_chunks(raw, 1), method=method)
    assert calls == [raw] and sent[0]["status"] == 200
