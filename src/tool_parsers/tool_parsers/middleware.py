"""ASGI middleware for stock vLLM's API server (`--middleware tool_parsers.middleware.Qwen38Middleware`).

vLLM applies `--middleware` classes last, so they are the outermost layer of the app
(`vllm/entrypoints/serve/middleware/register.py`). `Qwen38Middleware` composes, from
the outside in:

* `RequestTimelineMiddleware`: stamps HTTP receipt and the end of the request body,
  logs both spans per request, and logs requests that get no response within a
  stall threshold.
* `SseKeepAliveMiddleware`: `--sse-keep-alive-interval N` also for streaming
  `/v1/responses` and `/v1/messages` (stock covers only chat and completions).
* `ToolCallResponseMiddleware`: `/v1/messages` leaves out tool calls cut short
  (max_tokens or a stop string), and a chat completion without tool calls never
  reports `finish_reason="tool_calls"`.

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
from typing import Any

from tool_parsers.qwen38 import is_truncated_call

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger("vllm.plugins.tool_parsers.http")

KEEP_ALIVE_COMMENT = b": keep-alive\n\n"
KEEP_ALIVE_PATHS = ("/v1/responses", "/v1/messages")
REWRITTEN_PATHS = ("/v1/messages", "/v1/chat/completions")
# Request bodies are read for max_tokens only; a larger body is not inspected further.
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


class RequestTimelineMiddleware:
    """Stamp each HTTP request when it arrives and when its body has been read.

    Installed outermost, so the stamps are taken before any of vLLM's own layers
    run. One log line per request reports `body` (receipt → end of body),
    `first_byte` (end of body → response start) and `total`; a request still
    without a response after the stall threshold is logged while it waits and
    again when it ends.
    """

    def __init__(self, app: ASGIApp, stall_seconds: float | None = None) -> None:
        self.app = app
        self.stall_seconds = stall_seconds if stall_seconds is not None else _stall_seconds_from_env()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = time.monotonic()
        stamps: dict[str, float] = {}
        status: list[int] = []
        label = f"{scope.get('method', '')} {scope.get('path', '')}"

        async def timed_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                stamps.setdefault("body_end", time.monotonic())
            return message

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                stamps.setdefault("response_start", time.monotonic())
                status.append(int(message.get("status", 0)))
            await send(message)

        async def watch_stall() -> None:
            await asyncio.sleep(self.stall_seconds)
            if "response_start" not in stamps:
                logger.warning(
                    "%s: no response %.0f s after receipt (body %s)",
                    label,
                    self.stall_seconds,
                    "read" if "body_end" in stamps else "not fully read",
                )

        watchdog = asyncio.create_task(watch_stall())
        try:
            await self.app(scope, timed_receive, timed_send)
        finally:
            watchdog.cancel()
            with contextlib.suppress(BaseException):
                await watchdog
            self._log(label, received, stamps, status)

    def _log(self, label: str, received: float, stamps: dict[str, float], status: list[int]) -> None:
        done = time.monotonic()

        def ms(start: float | None, end: float | None) -> str:
            return "-" if start is None or end is None else f"{(end - start) * 1000:.1f}ms"

        body_end = stamps.get("body_end")
        response_start = stamps.get("response_start")
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


# ── R13 and finish_reason: tool-call responses ──────────────────────────────


def _drop_truncated_tool_use(body: dict[str, Any]) -> list[str]:
    """Remove tool_use blocks cut short from an Anthropic message; return their names."""
    content = body.get("content")
    if not isinstance(content, list):
        return []
    kept: list[Any] = []
    dropped: list[str] = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "tool_use" and is_truncated_call(block.get("id")):
            dropped.append(str(block.get("name")))
        else:
            kept.append(block)
    if dropped:
        body["content"] = kept or [{"type": "text", "text": ""}]
        if body.get("stop_reason") == "tool_use" and not any(
            isinstance(b, dict) and b.get("type") == "tool_use" for b in kept
        ):
            body["stop_reason"] = "end_turn"
    return dropped


def _requested_max_tokens(request_body: bytes) -> int | None:
    try:
        request = json.loads(request_body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    for key in ("max_completion_tokens", "max_tokens"):
        value = request.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _fix_chat_finish_reason(body: dict[str, Any], max_tokens: int | None) -> list[str]:
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
        cut = any(is_truncated_call(call.get("id")) for call in calls if isinstance(call, dict))
        if not calls:
            choice["finish_reason"] = "stop"
            changes.append("no parsed tool calls: stop")
        elif isinstance(choice.get("stop_reason"), str):
            continue  # a stop string: the stream reports "tool_calls" too
        elif cut or (hit_limit and len(body.get("choices") or ()) == 1):
            choice["finish_reason"] = "length"
            changes.append("output cut by max_tokens: length")
    return changes


class _SseEventFilter:
    """Hold each Anthropic tool_use block until its `content_block_stop`; drop it if it was cut short."""

    def __init__(self) -> None:
        self._buffer = b""
        self._held: list[bytes] | None = None
        self._held_index: int | None = None
        self._held_id: str | None = None
        self._held_name = ""
        self._removed = 0
        self.dropped: list[str] = []

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk
        out: list[bytes] = []
        while b"\n\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            out.extend(self._event(raw + b"\n\n"))
        return b"".join(out)

    def flush(self) -> bytes:
        rest = b"".join(self._held or []) + self._buffer
        self._held, self._buffer = None, b""
        return rest

    def _event(self, raw: bytes) -> list[bytes]:
        data = None
        for line in raw.split(b"\n"):
            if line.startswith(b"data:"):
                with contextlib.suppress(ValueError):
                    data = json.loads(line[5:].strip())
        if not isinstance(data, dict):
            return self._pass(raw)
        kind = data.get("type")
        index = data.get("index")
        if kind == "content_block_start":
            block = data.get("content_block") or {}
            if block.get("type") == "tool_use":
                released = self.flush_held()
                self._held, self._held_index = [], index
                self._held_id, self._held_name = block.get("id"), str(block.get("name"))
                return [*released, *self._hold(raw, data)]
        if self._held is not None and index == self._held_index:
            if kind == "content_block_stop":
                held = [*self._held, self._renumber(raw, data)]
                self._held = None
                if is_truncated_call(self._held_id):
                    self._removed += 1
                    self.dropped.append(self._held_name)
                    return []
                return held
            return self._hold(raw, data)
        return [*self.flush_held(), *self._pass(raw, data)]

    def flush_held(self) -> list[bytes]:
        held, self._held = self._held or [], None
        return held

    def _hold(self, raw: bytes, data: dict[str, Any]) -> list[bytes]:
        assert self._held is not None
        self._held.append(self._renumber(raw, data))
        return []

    def _pass(self, raw: bytes, data: dict[str, Any] | None = None) -> list[bytes]:
        return [self._renumber(raw, data) if data is not None else raw]

    def _renumber(self, raw: bytes, data: dict[str, Any]) -> bytes:
        # Blocks after a dropped one move down, so indices stay contiguous for the client.
        if not self._removed or not isinstance(data.get("index"), int):
            return raw
        data["index"] -= self._removed
        event = b""
        for line in raw.split(b"\n"):
            if line.startswith(b"event:"):
                event = line + b"\n"
        return event + b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


class ToolCallResponseMiddleware:
    """Post-process tool-call responses of `/v1/messages` and `/v1/chat/completions`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in REWRITTEN_PATHS:
            await self.app(scope, receive, send)
            return
        await _ResponseRewriter(path, send).run(self.app, scope, receive)


class _ResponseRewriter:
    def __init__(self, path: str, send: Send) -> None:
        self.path = path
        self._send = send
        self._start: Message | None = None
        self._mode = "pass"  # "json" buffers the body, "sse" filters events
        self._body: list[bytes] = []
        self._filter = _SseEventFilter()
        self._request_body = b""

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive) -> None:
        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and len(self._request_body) < _REQUEST_BODY_LIMIT:
                self._request_body += bytes(message.get("body", b""))
            return message

        await app(scope, recording_receive, self.send)

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            content_type = _header(message.get("headers"), b"content-type")
            if int(message.get("status", 200)) == 200 and content_type.startswith("application/json"):
                self._mode = "json"
                self._start = message
                return
            if self.path == "/v1/messages" and content_type.startswith("text/event-stream"):
                self._mode = "sse"
            await self._send(message)
            return
        if message["type"] != "http.response.body" or self._mode == "pass":
            await self._send(message)
            return
        more = bool(message.get("more_body", False))
        if self._mode == "sse":
            body = self._filter.feed(bytes(message.get("body", b"")))
            if not more:
                body += self._filter.flush()
                if self._filter.dropped:
                    logger.warning("/v1/messages: left out tool calls cut short: %s", ", ".join(self._filter.dropped))
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
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if isinstance(data, dict):
            changed = False
            if self.path == "/v1/messages":
                dropped = _drop_truncated_tool_use(data)
                if dropped:
                    changed = True
                    logger.warning("/v1/messages: left out tool calls cut short: %s", ", ".join(dropped))
            else:
                fixes = _fix_chat_finish_reason(data, _requested_max_tokens(self._request_body))
                if fixes:
                    changed = True
                    logger.warning("chat completion finish_reason corrected: %s", "; ".join(fixes))
            if changed:
                body = json.dumps(data, ensure_ascii=False).encode()
        headers = [(k, v) for k, v in self._start.get("headers", []) if bytes(k).lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self._send({**self._start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


class Qwen38Middleware:
    """All of the above, with the request timeline outermost."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = RequestTimelineMiddleware(SseKeepAliveMiddleware(ToolCallResponseMiddleware(app)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)
