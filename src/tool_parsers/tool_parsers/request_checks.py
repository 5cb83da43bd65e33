"""Request checks before vLLM sees a request (`RequestChecksMiddleware`, part of `Qwen38Middleware`).

Stock vLLM 0.32 answers most bad input with a clear HTTP 400 (malformed JSON, `max_tokens`
0 or negative, a prompt longer than `max_model_len`, a `tool_choice` naming no tool). This
layer covers what it does not, measured on the CPU server:

* A body that is not UTF-8 gets stock's bare `There was an error parsing the body`, and a
  JSON `\\ud800` escape (a lone UTF-16 surrogate, no Unicode character) reaches the
  tokenizer, which fails with `TextEncodeInput must be Union[...]`. Both are answered
  here with 400 naming the field that holds the bad text.
* Unknown top-level fields are ignored silently (vLLM logs them at debug level). Here a
  field that neither vLLM nor the upstream API (the `openai` / `anthropic` SDK's request
  parameters) defines is answered 400 naming it; a field the upstream API defines but vLLM
  does not implement is let through and logged, naming it, as ignored.
  `TOOL_PARSERS_UNKNOWN_FIELDS=warn` lets unknown fields through as well (logged).
* `n` up to `VLLM_MAX_N_SEQUENCES` (16,384 by default) copies of one request are accepted.
  Here `n` above `TOOL_PARSERS_MAX_N` (default 16) is answered 400 naming `n` and the limit.
* Tool parameter schemas are not checked: an invalid schema is accepted, reaches the
  grammar or the parser, and gives an HTTP 500 (`properties` given as a list, with
  `tool_choice="required"`), a cryptic 400 (`Invalid grammar specification: 'triggers'`
  for a strict tool) or nothing at all; a `$ref` cycle that never reaches a type
  (`A -> B -> A`) is accepted. Here each tool's schema is checked against its JSON Schema
  meta-schema, and every local `$ref` must reach a schema with a finite instance (a
  recursive schema with a base case, such as a tree whose `children` may be empty, is
  valid). Failures are 400 naming the tool (`tools[0].function.parameters ('name')`).
* `/v1/messages` with `tool_choice` `{"type": "tool", "name": X}` and no tool X: stock's
  400 does not name `tool_choice`; here it does.
* A client that sends part of a body and then nothing: stock waits for the rest for as
  long as the connection stays open. Here, after `TOOL_PARSERS_BODY_TIMEOUT_SECONDS`
  (default 30) without a byte, the request is answered 408 and logged.

Only POST requests to `/v1/chat/completions`, `/v1/completions`, `/v1/responses` and
`/v1/messages` are checked; the body is read whole, checked, and handed on unchanged.
Errors have the shape of the endpoint's own errors (OpenAI's `{"error": {...}}`, the
Messages API's `{"type": "error", "error": {...}}`), with `param` naming the field.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger("vllm.plugins.tool_parsers.checks")

MAX_N_ENV = "TOOL_PARSERS_MAX_N"
DEFAULT_MAX_N = 16
BODY_TIMEOUT_ENV = "TOOL_PARSERS_BODY_TIMEOUT_SECONDS"
DEFAULT_BODY_TIMEOUT = 30.0
UNKNOWN_FIELDS_ENV = "TOOL_PARSERS_UNKNOWN_FIELDS"
UNKNOWN_FIELDS_POLICIES = ("reject", "warn")

# path -> (vLLM's request model, upstream SDK request parameter TypedDicts)
_REQUEST_MODELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "/v1/chat/completions": (
        "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest",
        ("openai.types.chat.completion_create_params:CompletionCreateParamsBase",),
    ),
    "/v1/completions": (
        "vllm.entrypoints.openai.completion.protocol:CompletionRequest",
        ("openai.types.completion_create_params:CompletionCreateParamsBase",),
    ),
    "/v1/responses": (
        "vllm.entrypoints.openai.responses.protocol:ResponsesRequest",
        ("openai.types.responses.response_create_params:ResponseCreateParamsBase",),
    ),
    "/v1/messages": (
        "vllm.entrypoints.anthropic.protocol:AnthropicMessagesRequest",
        (
            "anthropic.types.message_create_params:MessageCreateParamsBase",
            "anthropic.types.beta.message_create_params:MessageCreateParamsBase",
        ),
    ),
}
CHECKED_PATHS = tuple(_REQUEST_MODELS)
N_PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class CheckFailure:
    """What to answer instead of passing the request on."""

    status: int
    param: str
    message: str


@dataclass(frozen=True)
class CheckSettings:
    max_n: int = DEFAULT_MAX_N
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    unknown_fields: str = "reject"

    @classmethod
    def from_env(cls) -> CheckSettings:
        return cls(
            max_n=int(_number_env(MAX_N_ENV, DEFAULT_MAX_N, integer=True)),
            body_timeout=_number_env(BODY_TIMEOUT_ENV, DEFAULT_BODY_TIMEOUT),
            unknown_fields=_policy_env(),
        )


def _number_env(name: str, default: float, integer: bool = False) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "a whole number" if integer else "a number"
        raise ValueError(f"{name}={raw!r} is not {kind} (default {default:g})") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value


def _policy_env() -> str:
    raw = os.environ.get(UNKNOWN_FIELDS_ENV, "") or "reject"
    if raw not in UNKNOWN_FIELDS_POLICIES:
        raise ValueError(f"{UNKNOWN_FIELDS_ENV}={raw!r}: use one of {', '.join(UNKNOWN_FIELDS_POLICIES)}")
    return raw


# ── text: UTF-8 and lone surrogates ─────────────────────────────────────────


def _path(parts: tuple[str | int, ...]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "body"


def _strings(node: Any, parts: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """Every string in a JSON value (keys included) with its path."""
    if isinstance(node, str):
        yield parts, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield parts, key
            yield from _strings(value, (*parts, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _strings(value, (*parts, index))


def _first_surrogate(text: str, low: int, high: int) -> int | None:
    for index, char in enumerate(text):
        if low <= ord(char) <= high:
            return index
    return None


def _non_utf8_failure(raw: bytes, error: UnicodeDecodeError) -> CheckFailure:
    where = ""
    try:
        # surrogateescape maps each undecodable byte to U+DC80..U+DCFF, so the JSON parses.
        parsed = json.loads(raw.decode("utf-8", errors="surrogateescape"))
    except ValueError:
        parsed = None
    field = "body"
    if parsed is not None:
        for parts, text in _strings(parsed):
            if _first_surrogate(text, 0xDC80, 0xDCFF) is not None:
                field = _path(parts)
                where = f" in {field}"
                break
    byte = raw[error.start]
    return CheckFailure(
        400,
        field,
        f"{field}: the request body is not valid UTF-8 (byte 0x{byte:02x} at offset {error.start}{where}); "
        f"send text as UTF-8",
    )


def _lone_surrogate_failure(request: Any) -> CheckFailure | None:
    for parts, text in _strings(request):
        index = _first_surrogate(text, 0xD800, 0xDFFF)
        if index is not None:
            field = _path(parts)
            return CheckFailure(
                400,
                field,
                f"{field}: contains a lone UTF-16 surrogate \\u{ord(text[index]):04x} at character {index}, "
                f"which is not a Unicode character; escape text as UTF-16 pairs or send it as UTF-8",
            )
    return None


# ── unknown fields ──────────────────────────────────────────────────────────


def _import(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


@functools.cache
def known_fields(path: str) -> tuple[frozenset[str], frozenset[str]]:
    """(fields vLLM's request model reads, fields only the upstream API defines) for an endpoint."""
    model_spec, upstream_specs = _REQUEST_MODELS[path]
    model = _import(model_spec)
    ours: set[str] = set()
    for name, field in model.model_fields.items():
        ours.add(name)
        for alias in (field.alias, field.validation_alias):
            if isinstance(alias, str):
                ours.add(alias)
    upstream: set[str] = set()
    for spec in upstream_specs:
        try:
            params = _import(spec)
        except (ImportError, AttributeError):
            continue  # an SDK that moved its types: only vLLM's own fields are known
        upstream |= set(params.__required_keys__) | set(params.__optional_keys__)
    return frozenset(ours), frozenset(upstream - ours)


_reported_ignored: set[tuple[str, tuple[str, ...]]] = set()


def _unknown_fields_failure(path: str, request: dict[str, Any], policy: str) -> CheckFailure | None:
    ours, upstream_only = known_fields(path)
    ignored = sorted(key for key in request if key not in ours and key in upstream_only)
    unknown = sorted(key for key in request if key not in ours and key not in upstream_only)
    if ignored and (path, tuple(ignored)) not in _reported_ignored:
        _reported_ignored.add((path, tuple(ignored)))  # once per endpoint and set of fields
        logger.warning("%s: ignoring field(s) this server does not implement: %s", path, ", ".join(ignored))
    if not unknown:
        return None
    names = ", ".join(repr(key) for key in unknown)
    them = "them" if len(unknown) > 1 else "it"
    if policy == "warn":
        logger.warning("%s: ignoring unknown field(s) %s (%s=warn)", path, names, UNKNOWN_FIELDS_ENV)
        return None
    return CheckFailure(
        400,
        unknown[0],
        f"{unknown[0]}: unknown field{'s' if len(unknown) > 1 else ''} {names} for {path}; "
        f"remove {them} (the server would ignore {them}; "
        f"an operator can let unknown fields through with {UNKNOWN_FIELDS_ENV}=warn)",
    )


# ── n ───────────────────────────────────────────────────────────────────────


def _n_failure(request: dict[str, Any], max_n: int) -> CheckFailure | None:
    n = request.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > max_n:
        return CheckFailure(
            400,
            "n",
            f"n: {n} is above this server's limit of {max_n} choices per request "
            f"(the operator sets it with {MAX_N_ENV})",
        )
    return None


# ── tool schemas ────────────────────────────────────────────────────────────


def _pointer(root: Any, ref: str) -> tuple[bool, Any]:
    """(found, target) of a document-local `$ref` ("#" or "#/a/b")."""
    if ref == "#":
        return True, root
    if not ref.startswith("#/"):
        return False, None
    node = root
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


def _local_refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            yield ref
        for value in node.values():
            yield from _local_refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _local_refs(item)


def _finite(node: Any, good: set[str], root: Any) -> bool:
    """Whether `node` has a finite instance, given the `$ref` targets known to have one."""
    if not isinstance(node, dict):
        return True  # true / false schemas and non-schemas: not a reference problem
    ref = node.get("$ref")
    if isinstance(ref, str) and ref not in good and _pointer(root, ref)[0]:
        return False
    all_of = node.get("allOf")
    if isinstance(all_of, list) and not all(_finite(s, good, root) for s in all_of):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(_finite(s, good, root) for s in branches):
            return False
    properties, required = node.get("properties"), node.get("required")
    if isinstance(properties, dict) and isinstance(required, list):
        for name in required:
            if isinstance(name, str) and name in properties and not _finite(properties[name], good, root):
                return False
    min_items = node.get("minItems")
    if isinstance(min_items, int) and min_items > 0:
        prefix = node.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        if not all(_finite(s, good, root) for s in prefix[:min_items]):
            return False
        if min_items > len(prefix) and "items" in node and not _finite(node["items"], good, root):
            return False
    return True


def ref_cycle_problem(schema: Any) -> str | None:
    """A local `$ref` (or the root) that can never reach a finite value, described; None if all can.

    Least fixed point over the reference targets: a target is good once its schema has a
    finite instance assuming only the targets already found good. Structure that may be
    left out (an optional property, an array that may be empty, one good `anyOf` branch)
    is a base case; `$ref`, `allOf`, required properties and `minItems` are not.
    """
    refs = sorted(set(_local_refs(schema)))
    good: set[str] = set()
    changed = True
    while changed:
        changed = False
        for ref in refs:
            found, target = _pointer(schema, ref)
            if ref not in good and found and _finite(target, good, schema):
                good.add(ref)
                changed = True
    for ref in refs:
        if ref not in good and _pointer(schema, ref)[0]:
            chain = [ref]
            target = _pointer(schema, ref)[1]
            while isinstance(target, dict) and isinstance(target.get("$ref"), str) and target["$ref"] not in chain:
                chain.append(target["$ref"])
                target = _pointer(schema, target["$ref"])[1]
            if isinstance(target, dict) and target.get("$ref") in chain:
                chain.append(target["$ref"])
            return (
                f"$ref {' -> '.join(repr(r) for r in chain)} never reaches a type: what it refers to leads back "
                f"to it with no base case (no finite value matches)"
            )
    if not _finite(schema, good, schema):
        return "the schema has no finite value: its required parts refer back to it with no base case"
    return None


@functools.lru_cache(maxsize=256)
def _schema_problem(text: str) -> str | None:
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import Draft202012Validator, validator_for

    schema = json.loads(text)
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path)
        return f"is not a valid JSON Schema: {error.message}" + (f" (at {where})" if where else "")
    problem = ref_cycle_problem(schema)
    return f"is not a usable JSON Schema: {problem}" if problem else None


def _tool_schemas(path: str, request: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(field path, tool name, schema) of each tool's parameter schema in a request."""
    tools = request.get("tools")
    if not isinstance(tools, list):
        return
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            continue
        if path == "/v1/messages":
            if "input_schema" in tool:
                yield f"tools[{index}].input_schema", str(tool.get("name")), tool["input_schema"]
        elif path == "/v1/responses":
            if tool.get("type") == "function" and "parameters" in tool:
                yield f"tools[{index}].parameters", str(tool.get("name")), tool["parameters"]
        else:
            function = tool.get("function")
            if isinstance(function, dict) and function.get("parameters") is not None:
                yield f"tools[{index}].function.parameters", str(function.get("name")), function["parameters"]


def _tools_failure(path: str, request: dict[str, Any]) -> CheckFailure | None:
    for field, name, schema in _tool_schemas(path, request):
        if not isinstance(schema, dict):
            continue  # vLLM's own validation names the field
        try:
            text = json.dumps(schema, sort_keys=True)
        except (TypeError, ValueError):
            continue
        problem = _schema_problem(text)
        if problem:
            return CheckFailure(400, field, f"{field} ({name!r}) {problem}")
    return None


def _anthropic_tool_choice_failure(request: dict[str, Any]) -> CheckFailure | None:
    choice = request.get("tool_choice")
    if not isinstance(choice, dict) or choice.get("type") != "tool":
        return None
    tools = request.get("tools")
    names = [t.get("name") for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []
    if choice.get("name") in names:
        return None
    listed = ", ".join(repr(n) for n in names) or "none"
    return CheckFailure(
        400,
        "tool_choice",
        f"tool_choice.name: {choice.get('name')!r} is not among the request's tools (tools: {listed})",
    )


# ── the whole request ───────────────────────────────────────────────────────


def check_request(path: str, raw: bytes, settings: CheckSettings) -> CheckFailure | None:
    """The failure to answer for this request body, or None to pass it on to vLLM."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return _non_utf8_failure(raw, error)
    try:
        request = json.loads(text)
    except ValueError:
        return None  # stock answers malformed JSON with 400 itself
    if not isinstance(request, dict):
        return None  # likewise
    checks: list[Callable[[], CheckFailure | None]] = [
        lambda: _lone_surrogate_failure(request),
        lambda: _unknown_fields_failure(path, request, settings.unknown_fields),
        lambda: _n_failure(request, settings.max_n) if path in N_PATHS else None,
        lambda: _tools_failure(path, request),
        lambda: _anthropic_tool_choice_failure(request) if path == "/v1/messages" else None,
    ]
    for check in checks:
        failure = check()
        if failure is not None:
            return failure
    return None


def error_body(path: str, failure: CheckFailure) -> bytes:
    """The error in the endpoint's own shape (as vLLM's own errors on that endpoint)."""
    kind = "BadRequestError" if failure.status == 400 else "RequestTimeoutError"
    if path == "/v1/messages":
        payload: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": failure.message}}
    else:
        payload = {"error": {"message": failure.message, "type": kind, "param": failure.param, "code": failure.status}}
    return json.dumps(payload, ensure_ascii=False).encode()


class RequestChecksMiddleware:
    """Answer the bad requests described in the module docstring before vLLM sees them."""

    def __init__(self, app: ASGIApp, settings: CheckSettings | None = None) -> None:
        self.app = app
        self.settings = settings if settings is not None else CheckSettings.from_env()
        # Import the request models and the SDKs' parameter types now, when the server
        # starts, rather than in the first request of each endpoint (seconds on a small CPU).
        for path in CHECKED_PATHS:
            try:
                known_fields(path)
            except (ImportError, AttributeError) as error:
                raise RuntimeError(
                    f"tool_parsers request checks: vLLM's request model for {path} "
                    f"({_REQUEST_MODELS[path][0]}) is gone ({error}); this vLLM is not 0.32 / 0.33"
                ) from None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in CHECKED_PATHS:
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive_within(receive, self.settings.body_timeout)
            if message is None:
                expected = _header(scope, b"content-length") or "?"
                timeout = CheckFailure(
                    408,
                    "body",
                    f"body: incomplete request body ({len(body)} of {expected} bytes) and nothing more "
                    f"for {self.settings.body_timeout:g} s ({BODY_TIMEOUT_ENV})",
                )
                logger.warning("POST %s: %s; answered 408", path, timeout.message)
                await _answer(send, path, timeout)
                return
            if message["type"] == "http.disconnect":
                logger.info("POST %s: client disconnected before its body ended (%d bytes)", path, len(body))
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        raw = bytes(body)
        failure = check_request(path, raw, self.settings)
        if failure is not None:
            logger.warning("POST %s rejected with %d: %s", path, failure.status, failure.message)
            await _answer(send, path, failure)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def receive_within(receive: Receive, timeout: float) -> Message | None:
    """The next ASGI message, or None when the client sent nothing for `timeout` seconds.

    Only time in which this server's event loop was free to read counts: the wait advances in
    ticks, and a tick that ends late (the loop was busy elsewhere: a long tokenization, a
    garbage collection, a starved process) counts as one tick. A body that arrived during such a
    stall is read, never answered 408; `asyncio.wait_for` would time out there on Python 3.12+,
    where the expiring timer cancels the read that the stall had delayed.
    """
    loop = asyncio.get_running_loop()
    tick = min(timeout / 8, 0.25)  # a stall costs the client one tick
    pending = asyncio.ensure_future(receive())
    silent = 0.0
    try:
        while True:
            start = loop.time()
            await asyncio.wait((pending,), timeout=tick)
            if not pending.done():
                await asyncio.sleep(0)  # let reads that a stall queued behind the timer run first
            if pending.done():
                return pending.result()
            silent += min(loop.time() - start, tick)
            if silent >= timeout:
                return None
    finally:
        pending.cancel()  # a no-op once it is done


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers") or ():
        if bytes(key).lower() == name:
            return bytes(value).decode("latin-1")
    return ""


async def _answer(send: Send, path: str, failure: CheckFailure) -> None:
    body = error_body(path, failure)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if failure.status == 408:
        headers.append((b"connection", b"close"))  # the rest of the body may still arrive
    await send({"type": "http.response.start", "status": failure.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
