"""`qwen38` reasoning parser and `qwen38_coder` tool parser: stock's Qwen3 engine plus fixes.

Built on stock vLLM's declarative Qwen3 parser engine (`vllm.parser.qwen3`), which
already carries most of the forks' tool-calling fixes. What this module changes:

* Parameter values are delimited by context, not by the first closing tag: a
  `</function>` inside a value is text, and a `</parameter>` only closes a value
  when whitespace and then `<parameter=`, or `</function>` that itself ends the
  call (followed by `</tool_call>`, `<tool_call>`, `<function=` or the end of the
  output), follow. Streaming holds such a `</function>` back until that is known.
* A call left open at the end of the output (max_tokens) keeps the arguments
  it has, in streaming and non-streaming alike; a tag the end cut in two is
  markup, not text. It is reported as cut short with its id, so the Anthropic
  layer can leave it out (see `tool_parsers.middleware`).
* Calls to functions that are not among the request's tools, `<tool_call>` blocks
  without a function name, and arguments whose value does not match the
  parameter's schema type are dropped; each is reported (`tool_call_issues`, in
  the request's `ParserFindings`, see `tool_parsers.request_context`) so the
  response can say what was dropped.
* Streamed calls are numbered by the calls actually sent (0, 1, 2, ...), their
  positions in the non-streamed `tool_calls`, whatever was dropped before them.
* `$ref` parameters are converted by the type of the referenced schema.
* `tool_choice="none"`: tool-call markup is returned verbatim as content, with
  nothing held back, streaming and non-streaming.
* A JSON answer (a request the middleware flagged, `JSON_ANSWER_KWARG`) never
  starts with the `<tool_call>` marker that ended the reasoning, and the marker
  is not fed to the JSON grammar.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from vllm import __version__ as vllm_version
from vllm.entrypoints.generate.base.protocol import DeltaMessage, ExtractedToolCallInformation
from vllm.exceptions import VLLMValidationError
from vllm.parser.engine.adapters import ParserEngineReasoningAdapter, ParserEngineToolAdapter
from vllm.parser.engine.events import EventType, SemanticEvent
from vllm.parser.engine.parser_engine import ParserEngine, ReasoningEnd
from vllm.parser.engine.parser_engine_config import ParserEngineConfig, ParserState
from vllm.parser.engine.streaming_parser_engine import StreamingParserEngine
from vllm.parser.engine.token_id_scanner import DROP_TERMINAL
from vllm.parser.qwen3 import Qwen3Parser, qwen3_config
from vllm.tool_parsers.utils import extract_types_from_schema, find_tool_properties

from tool_parsers.request_context import JSON_ANSWER_KWARG, report_findings
from tool_parsers.schema_refs import resolve_tool_refs, tool_parameters, unresolved_local_refs

logger = logging.getLogger("vllm.plugins.tool_parsers.qwen38")

TOOL_CALL_START = "<tool_call>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"
FUNCTION_CLOSE = "</function>"
# What may follow a `</function>` that really ends a call (besides whitespace and the end).
CALL_FOLLOWERS = ("</tool_call>", "<tool_call>", "<function=")

_TOOL_EVENT_TYPES = frozenset(
    (EventType.TOOL_CALL_START, EventType.TOOL_NAME, EventType.ARG_VALUE_CHUNK, EventType.TOOL_CALL_END)
)

# ── What this module relies on in stock vLLM ────────────────────────────────

# The subclasses below extend stock's parser engine through methods and attributes that
# are not a public API. They are checked when this module is imported, so a vLLM release
# that changes them fails at server start with this message instead of parsing wrongly.
EXPECTED_VLLM_SHAPE: dict[type, dict[str, tuple[str, ...]]] = {
    StreamingParserEngine: {
        "reset": ("self", "initial_state"),
        "_process_scanner_items": ("self", "items"),
        "_record_reasoning_tokens": ("self", "events"),
        "_on_terminal": ("self", "terminal", "value", "token_count"),
        "_emit_for_state": ("self", "text", "token_count"),
        "_apply_transition": ("self", "transition", "value", "token_count"),
        "_process_lex_tokens": ("self", "tokens"),
        "finish": ("self",),
    },
    Qwen3Parser: {
        "_check_skip_tool_parsing": ("self", "request"),
        "_accept_tool_name": ("self", "name"),
        "_events_to_delta": ("self", "events", "finished"),
        "_handle_arg_chunk": ("self", "event", "deltas"),
        "_handle_tool_end": ("self", "event", "deltas"),
        "_reset": ("self", "initial_state"),
        "_single_pass_parse": ("self", "text", "token_ids", "initial_state"),
        "_build_extracted_result": ("self", "deltas"),
        "_fix_arg_types": ("self", "args_json", "func_name"),
        "_safe_arg_prefix": ("json_str", "string_keys"),
        "_extract_name_and_args": ("self", "raw_body"),
        "find_reasoning_end": ("self", "token_ids"),
        "extract_tool_calls_from_content": ("self", "content", "request"),
        "extract_tool_calls_streaming": (
            "self",
            "previous_text",
            "current_text",
            "delta_text",
            "previous_token_ids",
            "current_token_ids",
            "delta_token_ids",
            "request",
        ),
        "finish_streaming": ("self",),
        "adjust_request": ("self", "request"),
    },
}


def check_vllm_shape(expected: dict[type, dict[str, tuple[str, ...]]] = EXPECTED_VLLM_SHAPE) -> None:
    """Raise RuntimeError naming every stock method whose name or parameters changed."""
    problems: list[str] = []
    for cls, methods in expected.items():
        for name, params in methods.items():
            method = getattr(cls, name, None)
            if not callable(method):
                problems.append(f"{cls.__qualname__}.{name} is missing")
                continue
            found = tuple(inspect.signature(method).parameters)
            if found != params:
                problems.append(f"{cls.__qualname__}.{name}{found} (expected {params})")
    if problems:
        raise RuntimeError(
            f"tool_parsers.qwen38 was built against vLLM 0.32/0.33's parser engine, and this vLLM "
            f"({vllm_version}) differs: {'; '.join(problems)}. Use a supported vLLM, or drop "
            f"--tool-call-parser qwen38_coder / --reasoning-parser qwen38 for stock qwen3_coder / qwen3."
        )


check_vllm_shape()

# ── Argument body → JSON ─────────────────────────────────────────────────────


def _strip_template_newlines(value: str) -> str:
    # The chat template writes "<parameter=x>\nVALUE\n</parameter>": one newline on each side is markup.
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _closes_value(after: str, partial: bool) -> bool:
    """Whether a `</parameter>` followed by `after` ends the value (not text inside it).

    It does when whitespace and then `<parameter=` follow, or a `</function>` that
    ends the call: one followed by whitespace and then `</tool_call>`, `<tool_call>`,
    `<function=` or nothing. The streaming engine applies the same rule to the
    `</function>` itself (see `Qwen38StreamingEngine`).
    """
    rest = after.lstrip()
    if not rest or rest.startswith(PARAM_OPEN):
        return True
    if rest.startswith(FUNCTION_CLOSE):
        tail = rest[len(FUNCTION_CLOSE) :].lstrip()
        if not tail or tail.startswith(CALL_FOLLOWERS):
            return True
        return partial and any(follower.startswith(tail) for follower in CALL_FOLLOWERS)
    # While streaming, the next tag may still be arriving.
    return partial and (PARAM_OPEN.startswith(rest) or FUNCTION_CLOSE.startswith(rest))


def parse_parameters(body: str, partial: bool = False) -> dict[str, str]:
    """Parameter name → raw string value from a Qwen3-coder call body.

    A value that is still open at the end of `body` (streaming, or a call cut
    short by max_tokens) keeps the text it has so far.
    """
    return _scan_parameters(body, partial)[0]


def open_parameter(body: str) -> str | None:
    """The parameter whose value is still open at the end of `body` (a call cut short), if any."""
    return _scan_parameters(body, partial=False)[1]


def _scan_parameters(body: str, partial: bool) -> tuple[dict[str, str], str | None]:
    params: dict[str, str] = {}
    pos = 0
    while True:
        start = body.find(PARAM_OPEN, pos)
        if start < 0:
            break
        name_end = body.find(">", start + len(PARAM_OPEN))
        if name_end < 0:
            break  # the parameter name itself is still incomplete
        name = body[start + len(PARAM_OPEN) : name_end].strip()
        value_start = name_end + 1
        search = value_start
        value: str | None = None
        while True:
            close = body.find(PARAM_CLOSE, search)
            if close < 0:
                break
            after = close + len(PARAM_CLOSE)
            if _closes_value(body[after:], partial):
                value = body[value_start:close]
                pos = after
                break
            search = after
        if value is None:
            if name:
                params[name] = _strip_template_newlines(body[value_start:])
                return params, name
            break
        if name:
            params[name] = _strip_template_newlines(value)
    return params, None


def convert_arguments(body: str, partial: bool) -> str:
    """The engine's argument converter: call body → JSON object text (always valid JSON)."""
    return json.dumps(parse_parameters(body, partial), ensure_ascii=False)


def qwen38_config(thinking: bool) -> ParserEngineConfig:
    return dataclasses.replace(
        qwen3_config(thinking=thinking, name="qwen38", turn_boundary_tokens=frozenset(("<|im_start|>", "<|im_end|>"))),
        arg_converter=convert_arguments,
        validate_tool_names=True,
        # Streaming cannot know that trailing whitespace precedes a call until the call
        # arrives, so it sends it; the non-streamed content keeps it too, so both agree.
        # Whitespace-only content before a call is still dropped in both.
        strip_content_whitespace_with_tools=False,
    )


# ── Streaming engine ────────────────────────────────────────────────────────


class _ValuePosition(Enum):
    OUTSIDE = "outside"  # between parameters
    INSIDE = "inside"  # inside a parameter value
    AFTER_CLOSE = "after_close"  # just after a `</parameter>`, only whitespace since


# Terminals after which a held `</function>` (see below) really ended the call. A
# special token the engine drops (e.g. an end-of-turn marker) ends it too.
_CALL_END_FOLLOWERS = frozenset(("TOOL_END", "TOOL_START", "FUNC_PREFIX", DROP_TERMINAL))
# States in which the output is inside a call that has not reached its `</function>`.
_OPEN_CALL_STATES = frozenset((ParserState.TOOL_PREAMBLE, ParserState.TOOL_NAME, ParserState.TOOL_ARGS))


@dataclass(frozen=True)
class CutCall:
    """The call the output ended inside of (max_tokens, a stop string, or an early end of turn)."""

    index: int  # among the calls the model wrote
    after_name: bool  # the end came after `<function=NAME>` was complete


class Qwen38StreamingEngine(StreamingParserEngine):
    """Stock streaming engine that knows whether it is inside a parameter value.

    Inside a value, `</function>` and `<parameter=` are text. A `</parameter>`
    followed by anything but whitespace or a new tag was text too, so the
    engine goes back inside the value. A `</function>` right after a
    `</parameter>` (only whitespace between) ends the call only if whitespace
    and then `</tool_call>`, `<tool_call>`, `<function=` or the end of the output
    follow; until that is known it is held back, and otherwise it (and the
    `</parameter>` before it) was text of the value. This matches `parse_parameters`.
    """

    def reset(self, initial_state: ParserState | None = None) -> None:
        super().reset(initial_state=initial_state)
        self._value_position = _ValuePosition.OUTSIDE
        self._held_function_end: list[tuple[str, int]] | None = None
        self.cut_call: CutCall | None = None

    def _commit_function_end(self) -> list[SemanticEvent]:
        held, self._held_function_end = self._held_function_end or [], None
        value, token_count = held[0]
        events = super()._on_terminal("FUNC_END", value, token_count)
        self._value_position = _ValuePosition.OUTSIDE
        for text, count in held[1:]:
            events.extend(super()._emit_for_state(text, count))
        return events

    def _release_function_end(self) -> list[SemanticEvent]:
        held, self._held_function_end = self._held_function_end or [], None
        self._value_position = _ValuePosition.INSIDE
        events: list[SemanticEvent] = []
        for text, count in held:
            events.extend(super()._emit_for_state(text, count))
        return events

    def _on_terminal(self, terminal: str, value: str, token_count: int = 0) -> list[SemanticEvent]:
        if self._held_function_end is not None:
            decided = self._commit_function_end() if terminal in _CALL_END_FOLLOWERS else self._release_function_end()
            return decided + self._on_terminal(terminal, value, token_count)
        if self.state is ParserState.TOOL_ARGS and not self.skip_tool_parsing:
            if terminal == "FUNC_END" and self._value_position is _ValuePosition.AFTER_CLOSE:
                self._held_function_end = [(value, token_count)]
                return []
            inside = self._value_position is _ValuePosition.INSIDE
            if terminal == "FUNC_END" and inside:
                return self._emit_for_state(value, token_count)
            if terminal == "PARAM_START":
                if inside:
                    return self._emit_for_state(value, token_count)
                events = super()._on_terminal(terminal, value, token_count)
                self._value_position = _ValuePosition.INSIDE
                return events
            if terminal == "PARAM_END" and inside:
                events = super()._on_terminal(terminal, value, token_count)
                self._value_position = _ValuePosition.AFTER_CLOSE
                return events
        return super()._on_terminal(terminal, value, token_count)

    def _emit_for_state(self, text: str, token_count: int = 0) -> list[SemanticEvent]:
        if self._held_function_end is not None:
            if not text.strip():
                self._held_function_end.append((text, token_count))
                return []
            return self._release_function_end() + self._emit_for_state(text, token_count)
        if self.state is ParserState.TOOL_ARGS and self._value_position is _ValuePosition.AFTER_CLOSE and text.strip():
            self._value_position = _ValuePosition.INSIDE
        return super()._emit_for_state(text, token_count)

    def _apply_transition(self, transition: Any, value: str, token_count: int = 0) -> list[SemanticEvent]:
        entering_args = self.state is not ParserState.TOOL_ARGS and transition.next_state is ParserState.TOOL_ARGS
        events = super()._apply_transition(transition, value, token_count)
        if entering_args:
            self._value_position = _ValuePosition.OUTSIDE
        return events

    def _process_lex_tokens(self, tokens: list[Any]) -> list[SemanticEvent]:
        # Stock treats a marker spelled with ordinary tokens as text once the stream has
        # carried token ids, but its non-streamed parse (text only) treats the same
        # spelling as the marker, so the two paths disagreed. Grammars (xgrammar
        # structural tags for required / named calls) do write `<tool_call>` that way, so
        # the spelled marker is a marker here too, and both paths agree.
        had_ids = self._ever_had_token_ids
        self._ever_had_token_ids = False
        try:
            return super()._process_lex_tokens(tokens)
        finally:
            self._ever_had_token_ids = had_ids

    def finish(self) -> list[SemanticEvent]:
        # Flush what the scanner and lexer still hold first: a held `</function>` followed
        # only by whitespace up to the end of the output ended its call.
        events = self._process_scanner_items(self._scanner.flush_pending())
        if self.state in _OPEN_CALL_STATES and not self.skip_tool_parsing:
            # Inside a call the lexer holds back only text that may begin a tag (`</`,
            # `</param`, `<func`); when the output ends there, it is a tag cut in two,
            # not text of a value or a name, in the stream and the whole parse alike.
            self._lexer.reset()
        events.extend(self._process_lex_tokens(self._lexer.flush()))
        if self._held_function_end is not None:
            events.extend(self._commit_function_end())
        self._record_reasoning_tokens(events)
        # A call whose `</function>` never came was cut short (max_tokens or a stop string).
        if self.state in _OPEN_CALL_STATES and self.tool_index >= 0 and not self.skip_tool_parsing:
            self.cut_call = CutCall(self.tool_index, after_name=self.state is ParserState.TOOL_ARGS)
        return events + super().finish()


# ── Parser engine ───────────────────────────────────────────────────────────


def _flags_json_answer(chat_template_kwargs: Any) -> bool:
    # The middleware decides which requests must answer in JSON (its endpoint rewriters hold
    # the rule) and marks them here, where every parser of the request can read it.
    return isinstance(chat_template_kwargs, Mapping) and bool(chat_template_kwargs.get(JSON_ANSWER_KWARG))


_JSON_TYPE_CHECKS: dict[str, Any] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def _matches_types(value: Any, types: Sequence[str]) -> bool:
    """Whether a converted argument has one of the schema's JSON types (unknown type names match)."""
    return any(_JSON_TYPE_CHECKS.get(kind, lambda v: True)(value) for kind in types) if types else True


# A trailing `"key": ` whose value the stream withholds, with the separator before it.
_TRAILING_KEY = re.compile(r'(?:,\s*)?"(?:[^"\\]|\\.)*"\s*:\s*$')


def kept_text(events: list[SemanticEvent]) -> bool:
    return any(event.type is EventType.TEXT_CHUNK and event.value.strip() for event in events)


class Qwen38Parser(Qwen3Parser):
    """Stock Qwen3 parser engine with the fixes listed in the module docstring."""

    CONFIG_NAME = "qwen38"

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None, **kwargs: Any) -> None:
        chat_kwargs = kwargs.get("chat_template_kwargs", {}) or {}
        kwargs.setdefault("parser_engine_config", qwen38_config(bool(chat_kwargs.get("enable_thinking", True))))
        resolved = resolve_tool_refs(tools)
        super().__init__(tokenizer, resolved, **kwargs)
        self._resolved_tools = resolved
        self._engine = Qwen38StreamingEngine(self.parser_engine_config, tokenizer, vocab=self.vocab)
        if not all(hasattr(self._engine, name) for name in ("_scanner", "_lexer")):
            raise RuntimeError(
                f"tool_parsers.qwen38: vLLM {vllm_version}'s StreamingParserEngine has no _scanner / _lexer; "
                f"use a supported vLLM (0.32 / 0.33) or stock qwen3_coder / qwen3"
            )
        # Set by the middleware for JSON answers (see JSON_ANSWER_KWARG); read in the engine core.
        self._json_answer_flag = _flags_json_answer(chat_kwargs)
        self.tool_call_issues: list[dict[str, Any]] = []
        # Issues go to the HTTP request only from a parser serving it (stock also builds
        # request-less copies, e.g. to count reasoning tokens, which know no tools).
        self._serving_request = False
        self._request_tools: object = tools
        self._markup_passthrough = False
        self._call_forced = False
        self._json_answer = False
        self._leading_marker_decided = False
        self._leading_pending = ""
        self._warned_names: set[str] = set()

    def adjust_request(self, request: Any) -> Any:
        # A local $ref that points nowhere fails later inside xgrammar with a message that
        # names neither the tool nor the reference; say which, and how to fix it.
        for position, tool in enumerate(getattr(request, "tools", None) or ()):
            name, params = tool_parameters(tool)
            missing = unresolved_local_refs(params) if params else []
            if missing:
                raise VLLMValidationError(
                    f"tools[{position}] ({name!r}): parameters use $ref {missing[0]!r}, which is not "
                    f"defined in the same schema; add it under the parameters' $defs (or definitions) "
                    f"or inline the referenced schema",
                    parameter="tools",
                    value=missing[0],
                )
        return super().adjust_request(request)

    def find_reasoning_end(self, token_ids: Sequence[int]) -> ReasoningEnd | None:
        # Stock feeds a `<tool_call>` that ended the reasoning to the grammar, as the first
        # token of a tool call. A JSON answer's grammar rejects it, and vLLM then ends the
        # request with an internal error; for those requests the grammar starts after it
        # (the parser drops the marker from the content).
        end = super().find_reasoning_end(token_ids)
        if end is not None and end.implicit and self._json_answer_flag:
            return end._replace(implicit=False)
        return end

    # Arguments that do not match their schema type

    def _mismatched_arguments(self, args_json: str, name: str) -> list[tuple[str, Any, list[str]]]:
        """(key, value, expected types) of each converted argument whose type the schema rules out."""
        if not self._tools or not name:
            return []
        try:
            args = json.loads(args_json)
        except ValueError:
            return []
        properties = find_tool_properties(self._tools, name)
        if not isinstance(args, dict) or not properties:
            return []
        mismatched = []
        for key, value in args.items():
            schema = properties.get(key)
            if isinstance(schema, dict):
                types = extract_types_from_schema(schema)
                if not _matches_types(value, types):
                    mismatched.append((key, value, sorted(types)))
        return mismatched

    def _fix_arg_types(self, args_json: str, func_name: str) -> str:
        fixed = super()._fix_arg_types(args_json, func_name)
        mismatched = self._mismatched_arguments(fixed, func_name)
        if not mismatched:
            return fixed
        args = json.loads(fixed)
        for key, _, _ in mismatched:
            del args[key]
        return json.dumps(args, ensure_ascii=False)

    @staticmethod
    def _safe_arg_prefix(json_str: str, string_keys: set[str] | None = None) -> str:
        # Stock streams `"key": ` before a non-string value is complete. Such a value may
        # still turn out not to match its type and be dropped, so the key waits with it.
        prefix = ParserEngine._safe_arg_prefix(json_str, string_keys)
        if not prefix.rstrip().endswith(":"):
            return prefix
        match = _TRAILING_KEY.search(prefix)
        return prefix[: match.start()] if match else prefix

    # What was dropped, for the response (tool_call_issues)

    def _collect_issues(self) -> list[dict[str, Any]]:
        issues: list[dict[str, Any]] = []
        cut: CutCall | None = self._engine.cut_call  # type: ignore[attr-defined]
        for index, slot in enumerate(self._tool_slots):
            name, raw = slot.name.strip(), slot.args
            if not name and raw.strip():
                name, _ = self._extract_name_and_args(raw)
            cut_here = cut is not None and cut.index == index
            if not self._accept_tool_name(name):
                if cut is not None and cut_here and not cut.after_name:
                    # The output ended before the call had (all of) its function name.
                    cut_name = name or None
                    issues.append({"issue": "cut_short", "action": "dropped_call", "index": index, "name": cut_name})
                elif name:
                    issues.append({"issue": "unknown_function", "action": "dropped_call", "index": index, "name": name})
                    self._warn_unknown_function(name)
                else:
                    detail = "a <tool_call> without <function=NAME>"
                    issues.append(
                        {"issue": "malformed", "action": "dropped_call", "index": index, "name": None, "detail": detail}
                    )
                continue
            call_id = slot.id or None
            # The value the end of the output left open may just be unfinished ("" or "-" of
            # an integer); leaving it out is part of the cut, reported as such below.
            unfinished = open_parameter(raw) if cut_here else None
            converted = ParserEngine._fix_arg_types(self, convert_arguments(raw, False), name)
            for key, value, expected in self._mismatched_arguments(converted, name):
                if key == unfinished:
                    continue
                issues.append(
                    {
                        "issue": "type_mismatch",
                        "action": "dropped_argument",
                        "index": index,
                        "id": call_id,
                        "name": name,
                        "argument": key,
                        "expected": expected,
                        "value": value,
                    }
                )
            if cut_here:
                issues.append(
                    {"issue": "cut_short", "action": "kept_incomplete", "index": index, "id": call_id, "name": name}
                )
        return issues

    def _warn_unknown_function(self, name: str) -> None:
        if name not in self._warned_names:
            self._warned_names.add(name)
            logger.warning("qwen38_coder: dropped a call to %r, which is not one of the request's tools", name)

    def _publish_issues(self) -> None:
        self.tool_call_issues = self._collect_issues()
        if self._serving_request and not self.skip_tool_parsing:
            report_findings(self.tool_call_issues)

    def _drop_blank_between_calls(self, events: list[SemanticEvent]) -> tuple[list[SemanticEvent], str]:
        """Leave out whitespace-only text between one call and the next (held or in `events`).

        Whitespace after a call stays held until what follows decides: text keeps it
        (in front of the text), another call or the end of the output drops it. Both
        parse paths see the same events, so streamed and non-streamed agree; and the
        Responses API does not open a message item for it between two calls. Returns
        the events and the whitespace after their last call, which nothing decided yet.
        """
        after_call = bool(self._tool_slots)
        kept: list[SemanticEvent] = []
        pending: list[SemanticEvent] = []
        for event in events:
            if event.type is EventType.TEXT_CHUNK and not event.value.strip():
                if after_call:
                    pending.append(event)
                    continue
            elif event.type is EventType.TEXT_CHUNK:
                kept.extend(pending)
                pending = []
                after_call = False
            elif event.type is EventType.TOOL_CALL_START:
                if after_call:
                    pending = []
                    if self._deferred_content and not self._deferred_content.strip() and not kept_text(kept):
                        self._deferred_content = ""
                after_call = True
            elif event.type in _TOOL_EVENT_TYPES:
                after_call = True
            kept.append(event)
        return kept, "".join(event.value for event in pending)

    def _drop_trailing_blank(self) -> None:
        # Whitespace after the last call, with no text after it, is not content: streaming
        # holds it until it knows, and the non-streamed parse drops it the same way.
        # (Responses would otherwise open a message item for it after the calls.)
        if self._tool_slots and self._deferred_content and not self._deferred_content.strip():
            self._deferred_content = ""

    # Request-dependent modes

    def _check_skip_tool_parsing(self, request: Any) -> None:
        super()._check_skip_tool_parsing(request)
        self._serving_request = True
        # The base class stores the request's tools as they are; keep the resolved copy.
        tools = getattr(request, "tools", None)
        if tools and tools is not self._request_tools:
            self._request_tools = tools
            self._resolved_tools = resolve_tool_refs(tools)
        if tools:
            self._tools = self._resolved_tools
        tool_choice = getattr(request, "tool_choice", None)
        self._markup_passthrough = tool_choice == "none"
        self._call_forced = tool_choice == "required" or (tool_choice is not None and not isinstance(tool_choice, str))
        self._json_answer = self._json_answer_flag or _flags_json_answer(getattr(request, "chat_template_kwargs", None))

    def _events_to_delta(self, events: list[SemanticEvent], finished: bool = False) -> DeltaMessage | None:
        # Whitespace the engine holds back (it may precede a call, where it is dropped) stays
        # held until something decides it: stock decided on a delta without events, and so
        # dropped it even when text followed. When text comes first, the held whitespace goes
        # in front of that text, not behind it.
        if not events and not finished:
            return None
        events, blank_after_call = self._drop_blank_between_calls(events)
        if finished and all(event.type is not EventType.TEXT_CHUNK or not event.value.strip() for event in events):
            self._drop_trailing_blank()
        if not finished and not events:
            # Whitespace after a call: stock drops it at once, though text may follow (and
            # then the non-streamed content keeps it). Hold it like the whitespace before a call.
            self._deferred_content += blank_after_call
            return None
        if self._deferred_content:
            for position, event in enumerate(events):
                if event.type in _TOOL_EVENT_TYPES:
                    break
                if event.type is EventType.TEXT_CHUNK and event.value.strip():
                    events = list(events)
                    events[position] = SemanticEvent(
                        EventType.TEXT_CHUNK,
                        value=self._deferred_content + event.value,
                        tool_index=event.tool_index,
                        token_count=event.token_count,
                    )
                    self._deferred_content = ""
                    break
        delta = super()._events_to_delta(events, finished)
        if blank_after_call and not finished:
            # Held the same way when it follows a call in this delta: stock held it only when
            # the delta also sent call deltas, and sent it at once after a dropped call.
            self._deferred_content += blank_after_call
        if delta is not None and delta.tool_calls:
            for call in delta.tool_calls:
                call.index = self._sent_position(call.index)
        if finished:
            self._publish_issues()
        return delta

    def _sent_position(self, slot_index: int) -> int:
        """A call's index in the stream: how many calls were sent before it.

        Stock numbers streamed calls by their slot, which counts the calls the model
        wrote, dropped ones included; clients fill their arrays by this index, so a
        dropped call left a hole (the `openai` client's stream helper raised
        IndexError). Calls are decided in the order they are written, so this is also
        the call's position in the non-streamed `tool_calls`.
        """
        return sum(1 for slot in self._tool_slots[:slot_index] if slot.name_sent)

    def _trim_pending_name(self, index: int) -> None:
        # Non-streaming strips the function name before checking it; streaming must
        # check (and send) the same name, or "<function=f\n" would differ between them.
        if 0 <= index < len(self._tool_slots):
            slot = self._tool_slots[index]
            if not slot.name_sent:
                slot.name = slot.name.strip()

    def _handle_arg_chunk(self, event: SemanticEvent, deltas: list[Any]) -> None:
        self._trim_pending_name(event.tool_index)
        super()._handle_arg_chunk(event, deltas)

    def _handle_tool_end(self, event: SemanticEvent, deltas: list[Any]) -> None:
        self._trim_pending_name(event.tool_index)
        super()._handle_tool_end(event, deltas)

    def _reset(self, initial_state: ParserState | None = None) -> None:
        super()._reset(initial_state=initial_state)
        self._leading_marker_decided = False
        self._leading_pending = ""

    # Leading `<tool_call>` of a JSON answer

    def _drop_leading_marker(self, text: str, final: bool) -> str:
        """Content with a leading `<tool_call>` removed when the answer must be JSON."""
        if not self._json_answer or self._leading_marker_decided:
            return text
        pending = self._leading_pending + text
        stripped = pending.lstrip()
        if not stripped:
            self._leading_pending = ""
            return pending
        lead = pending[: len(pending) - len(stripped)]
        if stripped.startswith(TOOL_CALL_START):
            self._leading_marker_decided = True
            self._leading_pending = ""
            return lead + stripped[len(TOOL_CALL_START) :]
        if TOOL_CALL_START.startswith(stripped) and not final:
            self._leading_pending = stripped
            return lead
        self._leading_marker_decided = True
        self._leading_pending = ""
        return pending

    # Non-streaming

    def extract_tool_calls_from_content(self, content: str, request: Any) -> ExtractedToolCallInformation:
        self._check_skip_tool_parsing(request)
        if self._markup_passthrough or self._json_answer:
            self._reset()
            text = self._drop_leading_marker(content, final=True)
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=text or None)
        return super().extract_tool_calls_from_content(content, request)

    def _single_pass_parse(
        self, text: str, token_ids: Sequence[int], initial_state: ParserState | None = None
    ) -> tuple[str | None, str | None, ExtractedToolCallInformation]:
        reasoning, content, info = super()._single_pass_parse(text, token_ids, initial_state)
        self._drop_trailing_blank()
        # Text the engine deferred behind a tool call (e.g. the newline between two calls after
        # earlier prose) is sent by the streaming path when the stream finishes; without this
        # the non-streamed content would silently lose it.
        if self._deferred_content:
            tail = self._events_to_delta([], finished=True)
            if tail is not None and tail.content:
                content = (content or "") + tail.content
        return reasoning, content, info

    def _build_extracted_result(self, *deltas: DeltaMessage | None) -> ExtractedToolCallInformation:
        result = super()._build_extracted_result(*deltas)
        self._publish_issues()
        return result

    # Streaming

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        self._check_skip_tool_parsing(request)
        if self._markup_passthrough or self._json_answer:
            self.initialize_streaming()
            text = self._drop_leading_marker(delta_text, final=False)
            return DeltaMessage(content=text) if text else None
        return super().extract_tool_calls_streaming(
            previous_text,
            current_text,
            delta_text,
            previous_token_ids,
            current_token_ids,
            delta_token_ids,
            request,
        )

    def finish_streaming(self) -> DeltaMessage | None:
        if self._leading_pending:
            text = self._drop_leading_marker("", final=True)
            return DeltaMessage(content=text) if text else None
        delta = super().finish_streaming()
        self._drop_trailing_blank()
        # Stock keeps text deferred behind a call when the final delta also carries tool
        # deltas, and nothing sends it afterwards; send it now, as non-streaming keeps it.
        if self._deferred_content:
            tail = self._events_to_delta([], finished=True)
            if tail is not None and tail.content:
                if delta is None:
                    delta = tail
                else:
                    delta.content = (delta.content or "") + tail.content
        # For required / named calls, vLLM's non-streaming path drops content that is only
        # whitespace; such content is still deferred here, so drop it the same way.
        forced_blank = self._call_forced and not self._content_has_nonws
        if forced_blank and delta is not None and delta.content and not delta.content.strip():
            delta.content = None
            if not delta.tool_calls and not delta.reasoning:
                delta = None
        self._publish_issues()
        return delta


class Qwen38ReasoningParser(ParserEngineReasoningAdapter):
    """`--reasoning-parser qwen38`."""

    _parser_engine_cls = Qwen38Parser


class Qwen38CoderToolParser(ParserEngineToolAdapter):
    """`--tool-call-parser qwen38_coder`: strict Qwen3-coder XML structural tags, as stock's qwen3_coder."""

    _parser_engine_cls = Qwen38Parser
    structural_tag_model = "qwen_3_coder"
