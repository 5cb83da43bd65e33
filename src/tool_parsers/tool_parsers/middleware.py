"""ASGI middleware for stock vLLM's API server (`--middleware tool_parsers.middleware.Qwen38Middleware`).

vLLM applies `--middleware` classes last, so they are the outermost layer of the app
(`vllm/entrypoints/serve/middleware/register.py`). `Qwen38Middleware` composes, from
the outside in:

* `RequestTimelineMiddleware`: stamps HTTP receipt and the end of the request body,
  adds both spans to vLLM's own request log (`--enable-log-requests`) through a
  logging filter, logs a timeline line per request, and logs requests that get no
  response within a stall threshold. It also opens the per-request record
  (`tool_parsers.request_context`) the other layers and the parsers share.
* `SseKeepAliveMiddleware`: `--sse-keep-alive-interval N` also for streaming
  `/v1/responses` and `/v1/messages` (stock covers only chat and completions).
* `ToolCallResponseMiddleware`: `/v1/messages` leaves out tool calls cut short
  (max_tokens or a stop string), a chat completion without tool calls never
  reports `finish_reason="tool_calls"`, every response says what the parsers
  dropped (`tool_call_issues`), and requests whose answer must be JSON are flagged
  for the engine's reasoning parser (so a `<tool_call>` that ends the reasoning
  does not reach the JSON grammar).

Each layer works on ASGI messages only, so none of vLLM's classes is patched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, ClassVar

from tool_parsers.request_checks import RequestChecksMiddleware
from tool_parsers.request_context import (
    ISSUES_FIELD,
    ISSUES_HEADER,
    JSON_ANSWER_KWARG,
    ParserFindings,
    RequestRecord,
    current_request,
    request_record,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger("vllm.plugins.tool_parsers.http")

KEEP_ALIVE_COMMENT = b": keep-alive\n\n"
KEEP_ALIVE_PATHS = ("/v1/responses", "/v1/messages")
# Request bodies are read for max_tokens and the answer format; a larger body is not inspected.
_REQUEST_BODY_LIMIT = 1 << 20
STALL_SECONDS_ENV = "TOOL_PARSERS_STALL_SECONDS"
DEFAULT_STALL_SECONDS = 60.0


def _header(headers: Any, name: bytes) -> str:
    for key, value in headers or ():
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


def _app_state(scope: Scope) -> Any:
    app = scope.get("app")
    return getattr(app, "state", None)


# ── K26: request timeline ───────────────────────────────────────────────────


def _stall_seconds_from_env() -> float:
    raw = os.environ.get(STALL_SECONDS_ENV, "")
    if not raw:
        return DEFAULT_STALL_SECONDS
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{STALL_SECONDS_ENV}={raw!r} is not a number; set it to the seconds after which a request "
            f"without a response is logged (default {DEFAULT_STALL_SECONDS:g})"
        ) from None
    if value <= 0:
        raise ValueError(f"{STALL_SECONDS_ENV} must be positive, got {raw!r}")
    return value


# vLLM's request logger (`--enable-log-requests`): its lines get the HTTP spans appended.
VLLM_REQUEST_LOGGER_MODULE = "vllm.entrypoints.serve.utils.request_logger"


class HttpSpansLogFilter(logging.Filter):
    """Append the current HTTP request's spans to each record of vLLM's request logger.

    The request's record lives in a context variable set by `RequestTimelineMiddleware`;
    vLLM logs `Received request …` from the request's own task, so the filter finds it.
    Records logged outside an HTTP request are left as they are.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        request = current_request()
        if request is not None and isinstance(record.msg, str) and "http_receipt_to_body_end=" not in record.msg:
            record.msg = f"{record.msg} ({request.spans().replace('%', '%%')})"
        return True


def install_request_log_filter() -> logging.Logger:
    """Add `HttpSpansLogFilter` to vLLM's request logger once; fail loudly if vLLM moved it."""
    import importlib

    try:
        module = importlib.import_module(VLLM_REQUEST_LOGGER_MODULE)
    except ImportError as error:
        raise RuntimeError(
            f"tool_parsers middleware: vLLM's request logger module {VLLM_REQUEST_LOGGER_MODULE} is gone "
            f"({error}); this vLLM is not 0.32 / 0.33. Use a supported vLLM or drop --middleware "
            f"tool_parsers.middleware.Qwen38Middleware."
        ) from None
    target = getattr(module, "logger", None)
    if not isinstance(target, logging.Logger):
        raise RuntimeError(f"tool_parsers middleware: {VLLM_REQUEST_LOGGER_MODULE}.logger is not a logging.Logger")
    if not any(isinstance(f, HttpSpansLogFilter) for f in target.filters):
        target.addFilter(HttpSpansLogFilter())
    return target


class RequestTimelineMiddleware:
    """Stamp each HTTP request when it arrives and when its body has been read.

    Installed outermost, so the stamps are taken before any of vLLM's own layers
    run. vLLM's request log (`--enable-log-requests`) gets both spans on its
    `Received request` line (receipt → end of body, end of body → that line), and
    one log line per request here reports `body` (receipt → end of body),
    `first_byte` (end of body → response start) and `total`; a request still
    without a response after the stall threshold is logged while it waits and
    again when it ends.
    """

    def __init__(self, app: ASGIApp, stall_seconds: float | None = None) -> None:
        self.app = app
        self.stall_seconds = stall_seconds if stall_seconds is not None else _stall_seconds_from_env()
        install_request_log_filter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with request_record(str(scope.get("method", "")), str(scope.get("path", ""))) as record:
            await self._serve(record, scope, receive, send)

    async def _serve(self, record: RequestRecord, scope: Scope, receive: Receive, send: Send) -> None:
        status: list[int] = []
        label = f"{record.method} {record.path}"

        async def timed_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False) and record.body_end is None:
                record.body_end = time.monotonic()
            return message

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                if record.response_start is None:
                    record.response_start = time.monotonic()
                status.append(int(message.get("status", 0)))
            await send(message)

        async def watch_stall() -> None:
            await asyncio.sleep(self.stall_seconds)
            if record.response_start is None:
                logger.warning(
                    "%s: no response %.0f s after receipt (body %s)",
                    label,
                    self.stall_seconds,
                    "read" if record.body_end is not None else "not fully read",
                )

        watchdog = asyncio.create_task(watch_stall())
        try:
            await self.app(scope, timed_receive, timed_send)
        finally:
            watchdog.cancel()
            with contextlib.suppress(BaseException):
                await watchdog
            self._log(label, record, status)

    def _log(self, label: str, record: RequestRecord, status: list[int]) -> None:
        done = time.monotonic()
        received = record.received

        def ms(start: float | None, end: float | None) -> str:
            return "-" if start is None or end is None else f"{(end - start) * 1000:.1f}ms"

        body_end = record.body_end
        response_start = record.response_start
        line = (
            f"{label} status={status[0] if status else '-'} body={ms(received, body_end)} "
            f"first_byte={ms(body_end, response_start)} total={ms(received, done)}"
        )
        if response_start is None and done - received >= self.stall_seconds:
            logger.warning("%s: ended without any response after %.1f s", line, done - received)
        else:
            logger.info("request timeline %s", line)


# ── R23: keep-alive for /v1/responses and /v1/messages ─────────────────────


_missing_interval_reported = False


def _configured_keep_alive(scope: Scope) -> float:
    # vLLM keeps its parsed CLI arguments in app.state.args (entrypoints/launchers/app.py).
    global _missing_interval_reported
    args = getattr(_app_state(scope), "args", None)
    if not hasattr(args, "sse_keep_alive_interval"):
        if not _missing_interval_reported:
            _missing_interval_reported = True
            logger.error(
                "tool_parsers keep-alive: app.state.args.sse_keep_alive_interval not found; this vLLM "
                "stores its arguments elsewhere, so /v1/responses and /v1/messages get no keep-alive "
                "comments. tool_parsers supports vLLM 0.32 and 0.33."
            )
        return 0.0
    try:
        return float(getattr(args, "sse_keep_alive_interval", 0) or 0)
    except (TypeError, ValueError):
        return 0.0


def _is_harmony(scope: Scope) -> bool:
    # Harmony (gpt-oss) streams are excluded, as for the fork.
    serving = getattr(_app_state(scope), "openai_serving_responses", None)
    return bool(getattr(serving, "use_harmony", False))


class SseKeepAliveMiddleware:
    """Send `: keep-alive` SSE comments on idle `/v1/responses` and `/v1/messages` streams.

    The interval is vLLM's own `--sse-keep-alive-interval` (read from `app.state.args`);
    0 (the default) turns it off. Comments go between the app's body chunks, which
    vLLM's routers send one whole SSE event at a time.
    """

    def __init__(self, app: ASGIApp, interval: float | None = None) -> None:
        self.app = app
        self.interval = interval

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in KEEP_ALIVE_PATHS:
            await self.app(scope, receive, send)
            return
        interval = self.interval if self.interval is not None else _configured_keep_alive(scope)
        if not 0 < interval < float("inf") or _is_harmony(scope):
            await self.app(scope, receive, send)
            return
        sender = _KeepAliveSender(send, interval)
        try:
            await self.app(scope, receive, sender.send)
        finally:
            await sender.stop()


class _KeepAliveSender:
    def __init__(self, send: Send, interval: float) -> None:
        self._send = send
        self._interval = interval
        self._lock = asyncio.Lock()
        self._last = time.monotonic()
        self._finished = False
        self._pump: asyncio.Task[None] | None = None

    async def send(self, message: Message) -> None:
        async with self._lock:
            await self._send(message)
            self._last = time.monotonic()
            if message["type"] == "http.response.start":
                content_type = _header(message.get("headers"), b"content-type")
                if content_type.startswith("text/event-stream"):
                    self._pump = asyncio.create_task(self._keep_alive())
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                self._finished = True

    async def _keep_alive(self) -> None:
        while not self._finished:
            await asyncio.sleep(max(0.0, self._last + self._interval - time.monotonic()))
            async with self._lock:
                if self._finished:
                    return
                if time.monotonic() - self._last >= self._interval:
                    await self._send({"type": "http.response.body", "body": KEEP_ALIVE_COMMENT, "more_body": True})
                    self._last = time.monotonic()

    async def stop(self) -> None:
        self._finished = True
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(BaseException):
                await self._pump


# ── R13, finish_reason, dropped calls: tool-call responses ──────────────────


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _requested_max_tokens(request: dict[str, Any] | None) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = (request or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _issues_header(issues: list[dict[str, Any]]) -> bytes:
    def one(issue: dict[str, Any]) -> str:
        target = str(issue.get("name") or "-")
        if issue.get("argument"):
            target += f".{issue['argument']}"
        return f"{issue.get('issue')}:{target}:{issue.get('action')}"

    return "; ".join(one(i) for i in issues).encode("ascii", "backslashreplace")


def _sse_data(raw: bytes) -> Any:
    for line in raw.split(b"\n"):
        if line.startswith(b"data:"):
            with contextlib.suppress(ValueError):
                return json.loads(line[5:].strip())
    return None


def _sse_event(raw: bytes, data: dict[str, Any]) -> bytes:
    """`raw`'s event line (if any) with new data."""
    event = b""
    for line in raw.split(b"\n"):
        if line.startswith(b"event:"):
            event = line + b"\n"
    return event + b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


class EndpointRewriter:
    """How one endpoint's responses are rewritten; one subclass per endpoint, one instance per request.

    `rewrite_body` fixes a non-streamed response; `feed` / `flush` rewrite a stream one
    SSE event at a time (a partial event waits for its end). Both add the parsers'
    `tool_call_issues` when there are some, and read what the parsers found from the
    request's `ParserFindings`. `wants_json_answer` decides from the request body whether
    the request is flagged for the parsers as a JSON answer.
    """

    path: ClassVar[str]

    def __init__(self, findings: ParserFindings, max_tokens: int | None = None) -> None:
        self.findings = findings
        self.max_tokens = max_tokens
        self._buffer = b""

    # The request

    @classmethod
    def wants_json_answer(cls, request: dict[str, Any]) -> bool:
        """The JSON-answer rule: the answer must be JSON, and no tool can be called."""
        can_call_tools = bool(request.get("tools")) and request.get("tool_choice", "auto") != "none"
        return not can_call_tools and cls._answer_must_be_json(request)

    @staticmethod
    def _answer_must_be_json(request: dict[str, Any]) -> bool:
        """Whether the request's answer format (in this endpoint's fields) is JSON."""
        return False

    # Non-streamed

    def rewrite_body(self, body: dict[str, Any]) -> bool:
        """Fix a non-streamed response in place; return whether it changed."""
        changed = self._fix_body(body)
        issues = self.findings.issues()
        if issues:
            body[ISSUES_FIELD] = issues
            changed = True
        return changed

    def _fix_body(self, body: dict[str, Any]) -> bool:
        return False

    # Streamed

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk
        out: list[bytes] = []
        while b"\n\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            out.extend(self._event(raw + b"\n\n"))
        return b"".join(out)

    def flush(self) -> bytes:
        """What is left when the stream ends."""
        rest, self._buffer = self._buffer, b""
        return rest

    def _event(self, raw: bytes) -> list[bytes]:
        return [raw]


def _fix_chat_finish_reason(body: dict[str, Any], max_tokens: int | None, findings: ParserFindings) -> list[str]:
    """Correct `finish_reason="tool_calls"` in a non-streamed chat completion; return what changed.

    vLLM reports "tool_calls" for every parsed auto call, even when the output was
    cut (the stream then says "length"), and for every `required` response, even
    when no call parsed. A choice whose output max_tokens cut reports "length", as
    the stream does, and one without calls reports "stop".
    """
    changes: list[str] = []
    usage = body.get("usage") or {}
    completion_tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    hit_limit = isinstance(completion_tokens, int) and max_tokens is not None and completion_tokens >= max_tokens
    for choice in body.get("choices") or ():
        if not isinstance(choice, dict) or choice.get("finish_reason") != "tool_calls":
            continue
        message = choice.get("message") or {}
        calls = message.get("tool_calls") or []
        cut = any(findings.is_cut_short(call.get("id")) for call in calls if isinstance(call, dict))
        if not calls:
            choice["finish_reason"] = "stop"
            changes.append("no parsed tool calls: stop")
        elif isinstance(choice.get("stop_reason"), str):
            continue  # a stop string: the stream reports "tool_calls" too
        elif cut or (hit_limit and len(body.get("choices") or ()) == 1):
            choice["finish_reason"] = "length"
            changes.append("output cut by max_tokens: length")
    return changes


class ChatCompletionsRewriter(EndpointRewriter):
    """`/v1/chat/completions`: a non-streamed `finish_reason` as the stream reports it; a
    last chunk (no choices) with `tool_call_issues` before `data: [DONE]`."""

    path = "/v1/chat/completions"

    def __init__(self, findings: ParserFindings, max_tokens: int | None = None) -> None:
        super().__init__(findings, max_tokens)
        self._chunk_fields: dict[str, Any] = {}

    @staticmethod
    def _answer_must_be_json(request: dict[str, Any]) -> bool:
        response_format = request.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type") in ("json_schema", "json_object"):
            return True
        structured = request.get("structured_outputs")
        return isinstance(structured, dict) and bool(structured.get("json") or structured.get("json_object"))

    def _fix_body(self, body: dict[str, Any]) -> bool:
        fixes = _fix_chat_finish_reason(body, self.max_tokens, self.findings)
        if fixes:
            logger.warning("chat completion finish_reason corrected: %s", "; ".join(fixes))
        return bool(fixes)

    def _event(self, raw: bytes) -> list[bytes]:
        if raw.strip() == b"data: [DONE]":
            issues = self.findings.issues()
            if issues:
                last = {**self._chunk_fields, "choices": [], ISSUES_FIELD: issues}
                return [b"data: " + json.dumps(last, ensure_ascii=False).encode() + b"\n\n", raw]
            return [raw]
        if not self._chunk_fields:
            data = _sse_data(raw)
            if isinstance(data, dict) and "id" in data:
                keys = ("id", "object", "created", "model")
                self._chunk_fields = {key: data[key] for key in keys if key in data}
        return [raw]


class ResponsesRewriter(EndpointRewriter):
    """`/v1/responses`: the final `response` object of a stream carries `tool_call_issues`."""

    path = "/v1/responses"
    FINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete", "response.failed")

    @staticmethod
    def _answer_must_be_json(request: dict[str, Any]) -> bool:
        text = request.get("text")
        answer_format = text.get("format") if isinstance(text, dict) else None
        return isinstance(answer_format, dict) and answer_format.get("type") in ("json_schema", "json_object")

    def _event(self, raw: bytes) -> list[bytes]:
        data = _sse_data(raw)
        if (
            isinstance(data, dict)
            and data.get("type") in self.FINAL_RESPONSE_EVENTS
            and isinstance(data.get("response"), dict)
        ):
            issues = self.findings.issues()
            if issues:
                data["response"][ISSUES_FIELD] = issues
                return [_sse_event(raw, data)]
        return [raw]


def _stop_reason_after_drop(stop_reason: Any, output_tokens: Any, max_tokens: int | None) -> Any:
    """An Anthropic stop_reason once the cut-short tool_use blocks are gone.

    vLLM says "tool_use" for an auto call whose output max_tokens cut; without the
    call, the message stopped at max_tokens (or, short of it, at a stop string).
    """
    if stop_reason != "tool_use":
        return stop_reason
    if isinstance(output_tokens, int) and max_tokens is not None and output_tokens >= max_tokens:
        return "max_tokens"
    return "end_turn"


class MessagesRewriter(EndpointRewriter):
    """`/v1/messages` (R13): `tool_use` blocks whose call was cut short are left out, and
    the blocks after them renumbered; a stream holds each `tool_use` block until its
    `content_block_stop` to know. `stop_reason` no longer says "tool_use" when no block
    is left; `message_delta` carries `tool_call_issues`."""

    path = "/v1/messages"

    def __init__(self, findings: ParserFindings, max_tokens: int | None = None) -> None:
        super().__init__(findings, max_tokens)
        self._held: list[bytes] | None = None
        self._held_index: int | None = None
        self._held_id: str | None = None
        self._held_name = ""
        self._removed = 0
        self._kept_tool_use = False
        self._left_out: list[str] = []

    def _leave_out(self, call_id: str, name: str) -> None:
        self.findings.mark_left_out(call_id)
        self._left_out.append(name)

    def _log_left_out(self) -> None:
        if self._left_out:
            logger.warning("/v1/messages: left out tool calls cut short: %s", ", ".join(self._left_out))

    def _fix_body(self, body: dict[str, Any]) -> bool:
        content = body.get("content")
        if not isinstance(content, list):
            return False
        kept: list[Any] = []
        for block in content:
            if (
                isinstance(block, dict)
                and block.get("type") == "tool_use"
                and self.findings.is_cut_short(block.get("id"))
            ):
                self._leave_out(str(block.get("id")), str(block.get("name")))
            else:
                kept.append(block)
        if len(kept) == len(content):
            return False
        body["content"] = kept or [{"type": "text", "text": ""}]
        if not any(isinstance(b, dict) and b.get("type") == "tool_use" for b in kept):
            usage = body.get("usage")
            output_tokens = usage.get("output_tokens") if isinstance(usage, dict) else None
            body["stop_reason"] = _stop_reason_after_drop(body.get("stop_reason"), output_tokens, self.max_tokens)
        self._log_left_out()
        return True

    def flush(self) -> bytes:
        rest = b"".join(self._flush_held()) + super().flush()
        self._log_left_out()
        return rest

    def _event(self, raw: bytes) -> list[bytes]:
        data = _sse_data(raw)
        if not isinstance(data, dict):
            return [*self._flush_held(), raw]
        kind = data.get("type")
        index = data.get("index")
        if kind == "content_block_start":
            block = data.get("content_block") or {}
            if block.get("type") == "tool_use":
                released = self._flush_held()
                self._held, self._held_index = [], index
                self._held_id, self._held_name = block.get("id"), str(block.get("name"))
                return [*released, *self._hold(raw, data)]
        if self._held is not None and index == self._held_index:
            if kind == "content_block_stop":
                held = [*self._held, self._renumber(raw, data)]
                self._held = None
                if self._held_id is not None and self.findings.is_cut_short(self._held_id):
                    self._removed += 1
                    self._leave_out(self._held_id, self._held_name)
                    return []
                self._kept_tool_use = True
                return held
            return self._hold(raw, data)
        if kind == "message_delta":
            changed = False
            delta = data.get("delta")
            if self._removed and isinstance(delta, dict) and not self._kept_tool_use:
                usage = data.get("usage")
                output_tokens = usage.get("output_tokens") if isinstance(usage, dict) else None
                stop_reason = _stop_reason_after_drop(delta.get("stop_reason"), output_tokens, self.max_tokens)
                changed = stop_reason != delta.get("stop_reason")
                delta["stop_reason"] = stop_reason
            issues = self.findings.issues()
            if issues:
                data[ISSUES_FIELD] = issues
                changed = True
            if changed:
                return [*self._flush_held(), _sse_event(raw, data)]
        return [*self._flush_held(), self._renumber(raw, data)]

    def _flush_held(self) -> list[bytes]:
        held, self._held = self._held or [], None
        return held

    def _hold(self, raw: bytes, data: dict[str, Any]) -> list[bytes]:
        assert self._held is not None
        self._held.append(self._renumber(raw, data))
        return []

    def _renumber(self, raw: bytes, data: dict[str, Any]) -> bytes:
        # Blocks after a dropped one move down, so indices stay contiguous for the client.
        if not self._removed or not isinstance(data.get("index"), int):
            return raw
        data["index"] -= self._removed
        return _sse_event(raw, data)


ENDPOINT_REWRITERS: dict[str, type[EndpointRewriter]] = {
    rewriter.path: rewriter for rewriter in (ChatCompletionsRewriter, ResponsesRewriter, MessagesRewriter)
}


def _flag_json_answer(request: dict[str, Any]) -> bytes | None:
    """The request body with the JSON-answer flag in chat_template_kwargs, or None if not possible."""
    kwargs = request.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return None  # vLLM reports the malformed field itself
    request = {**request, "chat_template_kwargs": {**(kwargs or {}), JSON_ANSWER_KWARG: True}}
    return json.dumps(request, ensure_ascii=False).encode()


class ToolCallResponseMiddleware:
    """Rewrite tool-call responses of the endpoints in `ENDPOINT_REWRITERS`.

    It reads what the parsers found from the request's record (`request_context`),
    which `RequestTimelineMiddleware` opens; used on its own, it opens one itself.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = None
        if scope["type"] == "http" and scope.get("method") == "POST":
            endpoint = ENDPOINT_REWRITERS.get(str(scope.get("path")))
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        with request_record(str(scope.get("method")), str(scope.get("path"))) as record:
            await _ResponseRewriter(endpoint(record.findings), send).run(self.app, scope, receive)


class _ResponseRewriter:
    """One response through its endpoint's rewriter: the JSON body whole, an SSE stream event by event."""

    def __init__(self, rewriter: EndpointRewriter, send: Send) -> None:
        self._rewriter = rewriter
        self._send = send
        self._start: Message | None = None
        self._mode = "pass"  # "json" buffers the body, "sse" rewrites events
        self._body: list[bytes] = []

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive) -> None:
        # Read the whole request body first (vLLM reads it whole anyway), so a JSON-answer
        # request can be flagged before vLLM builds its parsers and the engine request.
        first: list[Message] = []
        request_body = b""
        while True:
            message = await receive()
            first.append(message)
            if message["type"] != "http.request":
                break
            if len(request_body) < _REQUEST_BODY_LIMIT:
                request_body += bytes(message.get("body", b""))
            if not message.get("more_body", False):
                break
        request = _json_object(request_body)
        self._rewriter.max_tokens = _requested_max_tokens(request)
        if request is not None and first[-1]["type"] == "http.request" and self._rewriter.wants_json_answer(request):
            flagged = _flag_json_answer(request)
            if flagged is not None:
                first = [{"type": "http.request", "body": flagged, "more_body": False}]
                headers = [(k, v) for k, v in scope.get("headers", []) if bytes(k).lower() != b"content-length"]
                scope = {**scope, "headers": [*headers, (b"content-length", str(len(flagged)).encode())]}

        async def replay_receive() -> Message:
            return first.pop(0) if first else await receive()

        await app(scope, replay_receive, self.send)

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            content_type = _header(message.get("headers"), b"content-type")
            if int(message.get("status", 200)) == 200 and content_type.startswith("application/json"):
                self._mode = "json"
                self._start = message
                return
            if content_type.startswith("text/event-stream"):
                self._mode = "sse"
            await self._send(message)
            return
        if message["type"] != "http.response.body" or self._mode == "pass":
            await self._send(message)
            return
        more = bool(message.get("more_body", False))
        if self._mode == "sse":
            body = self._rewriter.feed(bytes(message.get("body", b"")))
            if not more:
                body += self._rewriter.flush()
            if body or not more:
                await self._send({"type": "http.response.body", "body": body, "more_body": more})
            return
        self._body.append(bytes(message.get("body", b"")))
        if more:
            return
        await self._send_json(b"".join(self._body))

    async def _send_json(self, raw: bytes) -> None:
        assert self._start is not None
        body = raw
        data = _json_object(raw)
        if data is not None and self._rewriter.rewrite_body(data):
            body = json.dumps(data, ensure_ascii=False).encode()
        headers = [(k, v) for k, v in self._start.get("headers", []) if bytes(k).lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        issues = self._rewriter.findings.issues() if data is not None else []
        if issues:
            headers.append((ISSUES_HEADER, _issues_header(issues)))
        await self._send({**self._start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


class Qwen38Middleware:
    """All of the above, with the request timeline outermost and the request checks
    (`tool_parsers.request_checks`) right inside it."""

    def __init__(self, app: ASGIApp) -> None:
        inner = SseKeepAliveMiddleware(ToolCallResponseMiddleware(app))
        self.app = RequestTimelineMiddleware(RequestChecksMiddleware(inner))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)
