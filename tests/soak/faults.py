"""Bad requests a server must answer (4xx, naming the field) and survive.

Each `Fault` is raw bytes for one endpoint (sent with httpx, or half sent over a raw
socket), the status it must get and the words its error message must contain. After each,
a normal request must still return its solo tokens (`canary`). Which of these stock vLLM
already answers well and which `tool_parsers.request_checks` answers is listed in the
root README's soak section.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx


@dataclass(frozen=True)
class Fault:
    name: str
    path: str
    body: bytes
    status: int
    words: tuple[str, ...]  # the error message contains each (case-insensitive): the field, the limit
    half_body: bool = False  # send the headers and half the body, then nothing


def _json(data: Any) -> bytes:
    return json.dumps(data).encode()


CYCLE = {
    "type": "object",
    "properties": {"x": {"$ref": "#/$defs/A"}},
    "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}},
}
SELF_CYCLE = {"type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"$ref": "#/$defs/A"}}}
# A recursive schema with a base case (children may be empty): valid.
TREE = {
    "type": "object",
    "properties": {"root": {"$ref": "#/$defs/Node"}},
    "required": ["root"],
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
# Recursion without a base case: every Node requires a next Node.
ENDLESS_LIST = {
    "type": "object",
    "properties": {"head": {"$ref": "#/$defs/Node"}},
    "$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}, "required": ["next"]}},
}
PROPERTIES_LIST = {"type": "object", "properties": [{"name": "x", "type": "string"}]}


def faults(model: str, max_model_len: int, max_n: int) -> list[Fault]:
    """The fault cases for a server with this model name, `max_model_len` and `n` limit."""
    user = [{"role": "user", "content": "hi"}]
    chat: dict[str, Any] = {"model": model, "messages": user, "max_tokens": 4, "temperature": 0}
    completion: dict[str, Any] = {"model": model, "prompt": "hi", "max_tokens": 4, "temperature": 0}
    message: dict[str, Any] = {"model": model, "messages": user, "max_tokens": 4}
    off = {"chat_template_kwargs": {"enable_thinking": False}}

    def tool(schema: Any, **extra: Any) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": "f", "parameters": schema, **extra}}]

    long_text = "word " * (max_model_len + 10)
    out = [
        # Stock vLLM answers these itself.
        Fault("malformed_json", "/v1/chat/completions", _json(chat)[:-9], 400, ("json",)),
        Fault("malformed_json_messages", "/v1/messages", _json(message)[:-3], 400, ("json",)),
        Fault("body_not_an_object", "/v1/chat/completions", b"[1, 2]", 400, ("dictionary",)),
        Fault("empty_body", "/v1/completions", b"", 400, ("body",)),
        Fault(
            "prompt_too_long_completions",
            "/v1/completions",
            _json({**completion, "prompt": [1000 + i % 5000 for i in range(2 * max_model_len)]}),
            400,
            ("maximum context length", "input_tokens"),
        ),
        Fault(
            "prompt_too_long_chat",
            "/v1/chat/completions",
            _json({**chat, "messages": [{"role": "user", "content": long_text}]}),
            400,
            ("maximum context length", "input_tokens"),
        ),
        Fault(
            "prompt_too_long_messages",
            "/v1/messages",
            _json({**message, "messages": [{"role": "user", "content": long_text}]}),
            400,
            ("maximum context length",),
        ),
        Fault("max_tokens_zero_chat", "/v1/chat/completions", _json({**chat, "max_tokens": 0}), 400, ("max_tokens",)),
        Fault(
            "max_tokens_zero_completions",
            "/v1/completions",
            _json({**completion, "max_tokens": 0}),
            400,
            ("max_tokens",),
        ),
        Fault("max_tokens_zero_messages", "/v1/messages", _json({**message, "max_tokens": 0}), 400, ("max_tokens",)),
        Fault(
            "max_tokens_negative_chat", "/v1/chat/completions", _json({**chat, "max_tokens": -1}), 400, ("max_tokens",)
        ),
        Fault(
            "max_completion_tokens_negative",
            "/v1/chat/completions",
            _json({**chat, "max_tokens": None, "max_completion_tokens": -5}),
            400,
            ("max_tokens",),
        ),
        Fault(
            "max_tokens_negative_messages", "/v1/messages", _json({**message, "max_tokens": -1}), 400, ("max_tokens",)
        ),
        Fault(
            "max_tokens_not_a_number",
            "/v1/chat/completions",
            _json({**chat, "max_tokens": "ten"}),
            400,
            ("max_tokens",),
        ),
        Fault(
            "tool_choice_unknown_function",
            "/v1/chat/completions",
            _json(
                {
                    **chat,
                    "tools": tool({"type": "object"}),
                    "tool_choice": {"type": "function", "function": {"name": "nope"}},
                }
            ),
            400,
            ("tool_choice",),
        ),
        Fault("n_zero", "/v1/chat/completions", _json({**chat, "n": 0}), 400, ("n must be at least 1",)),
        Fault("n_negative", "/v1/completions", _json({**completion, "n": -3}), 400, ("n must be at least 1",)),
        # tool_parsers.request_checks answers these (stock: 200, 500 or an unclear 400).
        Fault("unknown_field_chat", "/v1/chat/completions", _json({**chat, "max_tokenz": 4}), 400, ("max_tokenz",)),
        Fault(
            "unknown_field_completions",
            "/v1/completions",
            _json({**completion, "tempreature": 0}),
            400,
            ("tempreature",),
        ),
        Fault(
            "unknown_field_messages",
            "/v1/messages",
            _json({**message, "stop_sequence": ["x"]}),
            400,
            ("stop_sequence",),
        ),
        Fault(
            "tools_properties_not_an_object",
            "/v1/chat/completions",
            _json({**chat, **off, "tools": tool(PROPERTIES_LIST), "tool_choice": "required"}),
            400,
            ("tools[0].function.parameters", "properties"),
        ),
        Fault(
            "tools_unknown_type_strict",
            "/v1/chat/completions",
            _json({**chat, **off, "tools": tool({"type": "nonsense"}, strict=True)}),
            400,
            ("tools[0].function.parameters", "nonsense"),
        ),
        Fault(
            "tools_ref_cycle",
            "/v1/chat/completions",
            _json({**chat, **off, "tools": tool(CYCLE), "tool_choice": "required"}),
            400,
            ("tools[0].function.parameters", "$ref", "#/$defs/A", "never reaches a type"),
        ),
        Fault(
            "tools_ref_cycle_auto",
            "/v1/chat/completions",
            _json({**chat, "tools": tool(SELF_CYCLE)}),
            400,
            ("tools[0].function.parameters", "never reaches a type"),
        ),
        Fault(
            "tools_recursion_without_base_case",
            "/v1/chat/completions",
            _json({**chat, "tools": tool(ENDLESS_LIST)}),
            400,
            ("tools[0].function.parameters", "#/$defs/Node"),
        ),
        Fault(
            "tools_ref_cycle_messages",
            "/v1/messages",
            _json({**message, "tools": [{"name": "f", "input_schema": CYCLE}]}),
            400,
            ("tools[0].input_schema", "never reaches a type"),
        ),
        Fault(
            "tool_choice_unknown_tool_messages",
            "/v1/messages",
            _json(
                {
                    **message,
                    "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                    "tool_choice": {"type": "tool", "name": "nope"},
                }
            ),
            400,
            ("tool_choice", "nope"),
        ),
        Fault("n_above_limit_chat", "/v1/chat/completions", _json({**chat, "n": max_n + 1}), 400, ("n:", str(max_n))),
        Fault("n_huge_completions", "/v1/completions", _json({**completion, "n": 16384}), 400, ("n:", str(max_n))),
        Fault(
            "non_utf8_chat",
            "/v1/chat/completions",
            _json({**chat, "messages": [{"role": "user", "content": "a@@b"}]}).replace(b"@@", b"\xff\xfe"),
            400,
            ("messages[0].content", "utf-8"),
        ),
        Fault(
            "non_utf8_messages",
            "/v1/messages",
            _json({**message, "system": "s@@"}).replace(b"@@", b"\xc3\x28"),
            400,
            ("system", "utf-8"),
        ),
        Fault(
            "lone_surrogate_chat",
            "/v1/chat/completions",
            _json({**chat, "messages": [{"role": "user", "content": "a\ud800b"}]}),
            400,
            ("messages[0].content", "surrogate"),
        ),
        Fault(
            "lone_surrogate_completions",
            "/v1/completions",
            _json({**completion, "prompt": "x\udc00"}),
            400,
            ("prompt", "surrogate"),
        ),
        Fault("half_body_chat", "/v1/chat/completions", _json(chat), 408, ("body",), half_body=True),
        Fault("half_body_messages", "/v1/messages", _json(message), 408, ("body",), half_body=True),
    ]
    return out


# A valid request using a recursive schema with a base case: answered 200.
def tree_request(model: str) -> tuple[str, dict[str, Any]]:
    tools = [{"type": "function", "function": {"name": "plant", "parameters": TREE}}]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    return "/v1/chat/completions", {
        **body,
        "tools": tools,
        "tool_choice": "required",
        "chat_template_kwargs": {"enable_thinking": False},
    }


@dataclass
class FaultResult:
    status: int
    message: str
    seconds: float


def error_message(raw: bytes) -> str:
    """The message of an OpenAI-, Anthropic- or FastAPI-shaped error body (or the raw text)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            return f"{error.get('message', '')} (param={error.get('param')})"
        if "detail" in data:
            return json.dumps(data["detail"])
    return json.dumps(data)


async def send_fault(base_url: str, fault: Fault, body_timeout: float = 30.0) -> FaultResult:
    """Send one fault; a half body waits up to `body_timeout` + 30 s for the server's answer."""
    start = time.monotonic()
    if fault.half_body:
        return await asyncio.to_thread(_half_body, base_url, fault, body_timeout + 30, start)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        response = await http.post(fault.path, content=fault.body, headers={"Content-Type": "application/json"})
    return FaultResult(response.status_code, error_message(response.content), time.monotonic() - start)


def _half_body(base_url: str, fault: Fault, wait: float, start: float) -> FaultResult:
    url = urlsplit(base_url)
    head = (
        f"POST {fault.path} HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(fault.body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=wait) as sock:
        sock.sendall(head + fault.body[: len(fault.body) // 2])
        received = b""
        try:
            while b"\r\n\r\n" not in received or len(received) < _expected_length(received):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
        except TimeoutError:
            return FaultResult(0, f"no answer within {wait:.0f} s", time.monotonic() - start)
    status_line, _, rest = received.partition(b"\r\n")
    parts = status_line.split()
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    return FaultResult(status, error_message(rest.partition(b"\r\n\r\n")[2]), time.monotonic() - start)


def _expected_length(received: bytes) -> int:
    head, _, _ = received.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value.strip())
    return 1 << 62  # no Content-Length: read until the server closes
