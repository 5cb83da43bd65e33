"""The ASGI layers of tool_parsers.middleware, driven with small ASGI apps (no server)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from tests.tool_parsers.qwen38_harness import Qwen38Harness, render_call
from tool_parsers.middleware import (
    KEEP_ALIVE_COMMENT,
    Qwen38Middleware,
    RequestTimelineMiddleware,
    SseKeepAliveMiddleware,
    ToolCallResponseMiddleware,
)

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]


def run_app(app: App, path: str, state: Any = None, body: bytes = b"{}") -> list[Message]:
    sent: list[Message] = []
    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "app": SimpleNamespace(state=state)}
    chunks = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def sse_app(events: list[bytes], pause: float = 0.0) -> App:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i, event in enumerate(events):
            if i and pause:
                await asyncio.sleep(pause)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def json_app(payload: dict[str, Any]) -> App:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        raw = json.dumps(payload).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": raw, "more_body": False})

    return app


def body_of(sent: list[Message]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def keep_alive_state(interval: float, harmony: bool = False) -> Any:
    return SimpleNamespace(
        args=SimpleNamespace(sse_keep_alive_interval=interval),
        openai_serving_responses=SimpleNamespace(use_harmony=harmony),
    )


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_idle_stream_gets_keep_alive_comments(path: str) -> None:
    app = SseKeepAliveMiddleware(sse_app([b"data: a\n\n", b"data: b\n\n"], pause=0.5))
    # The interval comes from vLLM's --sse-keep-alive-interval in app.state.args; a float
    # here stands in for the whole seconds the flag takes, to keep the test short.
    body = body_of(run_app(app, path, keep_alive_state(0.05)))
    assert body.startswith(b"data: a\n\n")
    assert body.endswith(b"data: b\n\n")
    between = body[len(b"data: a\n\n") : -len(b"data: b\n\n")]
    assert between and between == KEEP_ALIVE_COMMENT * (len(between) // len(KEEP_ALIVE_COMMENT))


@pytest.mark.parametrize(
    ("path", "state"),
    [
        ("/v1/messages", keep_alive_state(0)),  # flag not given
        ("/v1/responses", keep_alive_state(0.05, harmony=True)),  # Harmony excluded
        ("/v1/chat/completions", keep_alive_state(0.05)),  # stock already covers it
    ],
)
def test_no_keep_alive_where_not_wanted(path: str, state: Any) -> None:
    app = SseKeepAliveMiddleware(sse_app([b"data: a\n\n", b"data: b\n\n"], pause=0.3))
    assert body_of(run_app(app, path, state)) == b"data: a\n\ndata: b\n\n"


def test_timeline_logs_receipt_body_and_first_byte(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.plugins.tool_parsers.http")
    run_app(RequestTimelineMiddleware(json_app({"ok": True}), stall_seconds=30), "/v1/chat/completions")
    lines = [r.getMessage() for r in caplog.records if "request timeline" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("request timeline POST /v1/chat/completions status=200 body=")
    assert "first_byte=" in lines[0] and "first_byte=-" not in lines[0] and "body=-" not in lines[0]


def test_request_without_response_is_logged_as_stalled(caplog: pytest.LogCaptureFixture) -> None:
    async def silent(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await asyncio.sleep(0.3)  # never answers, as a request lost inside the server would

    caplog.set_level(logging.INFO, logger="vllm.plugins.tool_parsers.http")
    run_app(RequestTimelineMiddleware(silent, stall_seconds=0.05), "/v1/messages")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("/v1/messages: no response" in w for w in warnings)
    assert any("status=- " in w and "ended without any response" in w for w in warnings)


def test_stall_threshold_env_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOL_PARSERS_STALL_SECONDS", "soon")
    with pytest.raises(ValueError, match="TOOL_PARSERS_STALL_SECONDS='soon' is not a number"):
        RequestTimelineMiddleware(json_app({}))


def parsing_app(harness: Qwen38Harness, respond: Callable[[str, str], dict[str, Any] | list[bytes]]) -> App:
    """An app that, as vLLM's handler does, runs the real parser inside the request, here on an
    output whose second call max_tokens cut, then sends `respond(complete_id, cut_id)`: a JSON
    body, or the events of a stream."""
    cut_call = render_call("write_file", {"path": "a", "content": "b"})
    output = render_call("get_weather", {"city": "Paris"}) + "\n" + cut_call[: cut_call.index("<parameter=content>")]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        parser, request = harness._new_parser(harness.request(), thinking=False)
        _, _, calls = parser.parse(output, request, enable_auto_tools=True)
        assert [c.name for c in calls] == ["get_weather", "write_file"]
        response = respond(calls[0].id, calls[1].id)
        if isinstance(response, list):
            await sse_app(response)(scope, receive, send)
        else:
            await json_app(response)(scope, receive, send)

    return app


CUT_CALL_LEFT_OUT = [{"issue": "cut_short", "action": "dropped_call", "index": 1, "name": "write_file"}]


def test_messages_leave_out_call_cut_short(harness: Qwen38Harness) -> None:
    ids: list[str] = []

    def message(complete: str, cut: str) -> dict[str, Any]:
        ids.extend((complete, cut))
        content = [
            {"type": "text", "text": "hi"},
            {"type": "tool_use", "id": complete, "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": cut, "name": "write_file", "input": {"path": "a"}},
        ]
        return {"type": "message", "content": content, "stop_reason": "max_tokens"}

    # ToolCallResponseMiddleware on its own opens the request's record for the parser's findings.
    sent = run_app(ToolCallResponseMiddleware(parsing_app(harness, message)), "/v1/messages")
    body = json.loads(body_of(sent))
    assert [b.get("id") for b in body["content"]] == [None, ids[0]]
    assert body["stop_reason"] == "max_tokens"
    assert body["tool_call_issues"] == CUT_CALL_LEFT_OUT
    length = dict(sent[0]["headers"])[b"content-length"]
    assert int(length) == len(body_of(sent))


def test_messages_stream_leaves_out_call_cut_short(harness: Qwen38Harness) -> None:
    ids: list[str] = []

    def event(kind: str, **data: Any) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    def events(complete: str, cut: str) -> list[bytes]:
        ids.extend((complete, cut))
        return [
            event("message_start", message={}),
            event("content_block_start", index=0, content_block={"type": "tool_use", "id": cut, "name": "w"}),
            event("content_block_delta", index=0, delta={"type": "input_json_delta", "partial_json": "{"}),
            event("content_block_stop", index=0),
            event("content_block_start", index=1, content_block={"type": "tool_use", "id": complete, "name": "g"}),
            event("content_block_stop", index=1),
            event("message_delta", delta={"stop_reason": "max_tokens"}),
        ]

    body = body_of(run_app(ToolCallResponseMiddleware(parsing_app(harness, events)), "/v1/messages")).decode()
    parsed = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:")]
    assert [(p["type"], p.get("index")) for p in parsed] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_stop", 0),
        ("message_delta", None),
    ]
    assert parsed[1]["content_block"]["id"] == ids[0]
    assert parsed[-1]["tool_call_issues"] == CUT_CALL_LEFT_OUT


def test_chat_finish_reason_without_calls_is_stop() -> None:
    response = {
        "choices": [
            {"index": 0, "message": {"content": "no call", "tool_calls": []}, "finish_reason": "tool_calls"},
            {"index": 1, "message": {"tool_calls": [{"id": "x"}]}, "finish_reason": "tool_calls"},
        ]
    }
    body = json.loads(body_of(run_app(ToolCallResponseMiddleware(json_app(response)), "/v1/chat/completions")))
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "tool_calls"]


def test_chat_finish_reason_of_a_cut_output_is_length(harness: Qwen38Harness) -> None:
    complete, cut = 0, 1

    def finish(call: int, completion_tokens: int, request: dict[str, Any]) -> str:
        def response(*call_ids: str) -> dict[str, Any]:
            message = {"tool_calls": [{"id": call_ids[call], "type": "function"}]}
            return {
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls", "stop_reason": None}],
                "usage": {"completion_tokens": completion_tokens},
            }

        app = ToolCallResponseMiddleware(parsing_app(harness, response))
        sent = run_app(app, "/v1/chat/completions", body=json.dumps(request).encode())
        return str(json.loads(body_of(sent))["choices"][0]["finish_reason"])

    assert finish(cut, 7, {"max_tokens": 64}) == "length"
    assert finish(complete, 64, {"max_tokens": 64}) == "length"
    assert finish(complete, 20, {"max_tokens": 64}) == "tool_calls"
    assert finish(complete, 20, {}) == "tool_calls"


def test_combined_middleware_passes_other_routes_untouched() -> None:
    payload = {"data": [{"id": "tiny"}]}
    sent = run_app(Qwen38Middleware(json_app(payload)), "/v1/models")
    assert json.loads(body_of(sent)) == payload


def test_keep_alive_says_so_when_vllm_moves_its_arguments(caplog: pytest.LogCaptureFixture) -> None:
    import tool_parsers.middleware as middleware

    middleware._missing_interval_reported = False
    caplog.set_level(logging.ERROR, logger="vllm.plugins.tool_parsers.http")
    app = SseKeepAliveMiddleware(sse_app([b"data: a\n\n"]))
    assert body_of(run_app(app, "/v1/messages", SimpleNamespace())) == b"data: a\n\n"
    assert any("app.state.args.sse_keep_alive_interval not found" in r.getMessage() for r in caplog.records)


def test_json_answer_requests_are_flagged_for_the_engine() -> None:
    """The flag reaches vLLM in the request body (chat_template_kwargs), with a matching content-length."""
    seen: list[tuple[bytes, dict[bytes, bytes]]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        seen.append((message["body"], dict(scope["headers"])))
        await json_app({})(scope, lambda: _done(), send)

    async def _done() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    from tool_parsers.request_context import JSON_ANSWER_KWARG

    json_answer = {"response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": True}}
    with_tools = {**json_answer, "tools": [{"type": "function", "function": {"name": "f"}}]}
    responses = {"text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}}
    for path, request, flagged in [
        ("/v1/chat/completions", json_answer, True),
        ("/v1/chat/completions", with_tools, False),
        ("/v1/chat/completions", {**with_tools, "tool_choice": "none"}, True),
        ("/v1/chat/completions", {"structured_outputs": {"json": {"type": "object"}}}, True),
        ("/v1/chat/completions", {"structured_outputs": {"json_object": True}}, True),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "[a-z]+"}}, False),
        ("/v1/responses", responses, True),
        ("/v1/responses", {**responses, "tools": [{"type": "function", "name": "f"}]}, False),
        ("/v1/chat/completions", {"messages": []}, False),
    ]:
        seen.clear()
        run_app(ToolCallResponseMiddleware(app), path, body=json.dumps(request).encode())
        body, headers = seen[0]
        kwargs = json.loads(body).get("chat_template_kwargs") or {}
        assert kwargs.get(JSON_ANSWER_KWARG, False) is flagged, (path, request)
        if flagged:
            assert kwargs.get("enable_thinking", True) is True
            assert int(headers[b"content-length"]) == len(body)


def test_request_log_filter_adds_the_http_spans(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's request logger gets the spans of the request whose handler logs."""
    target = logging.getLogger("vllm.entrypoints.serve.utils.request_logger")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        target.info("Received request %s: params: %s", "chatcmpl-1", "x")
        await json_app({})(scope, receive, send)

    caplog.set_level(logging.INFO, logger=target.name)
    run_app(RequestTimelineMiddleware(app, stall_seconds=30), "/v1/chat/completions")
    target.info("Received request %s outside HTTP", "other")
    lines = [r.getMessage() for r in caplog.records if r.name == target.name]
    assert len(lines) == 2
    assert lines[0].startswith("Received request chatcmpl-1: params: x (http_receipt_to_body_end=")
    assert "body_end_to_now=" in lines[0] and "=-" not in lines[0]
    assert lines[1] == "Received request other outside HTTP"
