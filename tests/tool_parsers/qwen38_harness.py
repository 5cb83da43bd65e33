"""Drive the qwen38 parsers the way stock vLLM's chat serving does, without an engine.

One `Parser` per request built by stock `ParserManager` from the registered names
(`--tool-call-parser qwen38_coder --reasoning-parser qwen38`), `adjust_request`
on a separate instance (as the renderer does), then either `parse` on the whole
output or `parse_delta` on successive token chunks with their decoded text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser import ParserManager

import tool_parsers
from tests.tool_definitions import GET_WEATHER, WRITE_FILE

TOOLS: list[dict[str, Any]] = [
    GET_WEATHER,
    WRITE_FILE,
    {
        "type": "function",
        "function": {
            "name": "set_limits",
            "description": "Parameters typed through $ref",
            "parameters": {
                "type": "object",
                "properties": {
                    "count": {"$ref": "#/$defs/Count"},
                    "ratio": {"$ref": "#/definitions/Ratio"},
                    "flags": {"$ref": "#/$defs/Flags"},
                },
                "$defs": {
                    "Count": {"type": "integer"},
                    "Flags": {"type": "object", "properties": {"strict": {"type": "boolean"}}},
                },
                "definitions": {"Ratio": {"type": "number"}},
            },
        },
    },
]


def render_call(name: str, arguments: dict[str, str]) -> str:
    """A call in the Qwen3-coder XML format, as the chat template renders it."""
    params = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def issues_of(parser: Any) -> list[dict[str, Any]]:
    """tool_call_issues of the request's tool parser (stock composes the two adapters' engines)."""
    engine = parser._tool_parser._parser_engine
    return [{k: v for k, v in issue.items() if k != "id"} for issue in engine.tool_call_issues]


@dataclass
class Parsed:
    reasoning: str | None
    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)
    # Streaming only: (text of the chunk, content the parser returned for it).
    chunks: list[tuple[str, str | None]] = field(default_factory=list)
    # What the parser reported as dropped (tool_call_issues), without the random call ids.
    issues: list[dict[str, Any]] = field(default_factory=list)
    # The index each call has: its position in `tool_calls` (non-streamed), the index its
    # deltas carry (streamed), in the order the calls appear.
    indices: list[int] = field(default_factory=list)

    def arguments(self, index: int) -> Any:
        return json.loads(self.calls[index][1])


class Qwen38Harness:
    def __init__(self, tokenizer: Any) -> None:
        tool_parsers.register()
        self.tokenizer = tokenizer
        self.parser_cls = ParserManager.get_parser(
            tool_parser_name="qwen38_coder",
            reasoning_parser_name="qwen38",
            enable_auto_tools=True,
            tokenizer=tokenizer,
        )
        assert self.parser_cls is not None

    def request(self, **fields: Any) -> ChatCompletionRequest:
        body: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        body.update(fields)
        return ChatCompletionRequest(**body)

    def _new_parser(self, request: ChatCompletionRequest, thinking: bool) -> tuple[Any, ChatCompletionRequest]:
        # As vLLM's serving: the request's own chat_template_kwargs reach the parser too.
        kwargs = {"chat_template_kwargs": {**(request.chat_template_kwargs or {}), "enable_thinking": thinking}}
        adjusted = self.parser_cls(self.tokenizer, request.tools, **kwargs).adjust_request(request)
        return self.parser_cls(self.tokenizer, adjusted.tools, **kwargs), adjusted

    def prompt_ids(self, thinking: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}],
            tools=TOOLS,
            add_generation_prompt=True,
            tokenize=True,
            enable_thinking=thinking,
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_spelled(self, text: str) -> list[int]:
        """Token ids with every special marker spelled in ordinary tokens, as a grammar writes it."""
        ids: list[int] = []
        for part in re.split(r"(</?tool_call>|</?think>)", text):
            if re.fullmatch(r"</?tool_call>|</?think>", part):
                ids.extend(self.encode(part[:1]))
                ids.extend(self.encode(part[1:]))
            elif part:
                ids.extend(self.encode(part))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def parse_full(self, ids: Sequence[int], request_fields: dict[str, Any], thinking: bool) -> Parsed:
        parser, request = self._new_parser(self.request(**request_fields), thinking)
        reasoning, content, calls = parser.parse(
            self.decode(ids), request, enable_auto_tools=True, model_output_token_ids=list(ids)
        )
        found = [(call.name, call.arguments) for call in calls or []]
        return Parsed(reasoning, content, found, issues=issues_of(parser), indices=list(range(len(found))))

    def parse_both(self, ids: Sequence[int], request_fields: dict[str, Any], thinking: bool) -> tuple[Parsed, Parsed]:
        """Non-streamed parse and token-by-token stream of the same output."""
        full = self.parse_full(ids, request_fields, thinking)
        return full, self.parse_stream(ids, range(1, len(ids)), request_fields, thinking)

    def parse_stream(
        self, ids: Sequence[int], cuts: Sequence[int], request_fields: dict[str, Any], thinking: bool
    ) -> Parsed:
        """Feed `ids` in chunks that end at the sorted positions `cuts` (plus the end)."""
        parser, request = self._new_parser(self.request(**request_fields), thinking)
        prompt = self.prompt_ids(thinking)
        bounds = sorted({c for c in cuts if 0 < c < len(ids)} | {len(ids)})
        reasoning: list[str] = []
        content: list[str] = []
        calls: dict[int, list[str]] = {}
        indices: list[int] = []
        chunks: list[tuple[str, str | None]] = []
        start = 0
        previous_text = ""
        for end in bounds:
            text = self.decode(ids[:end])
            if end < len(ids):
                # As vLLM's incremental detokenizer, hold back a character whose bytes are incomplete.
                text = text.rstrip("\ufffd")
            assert text.startswith(previous_text)
            delta_text = text[len(previous_text) :]
            previous_text = text
            delta = parser.parse_delta(
                delta_text, list(ids[start:end]), request, prompt_token_ids=prompt, finished=end == len(ids)
            )
            start = end
            chunks.append((delta_text, delta.content if delta is not None else None))
            if delta is None:
                continue
            if delta.reasoning:
                reasoning.append(delta.reasoning)
            if delta.content:
                content.append(delta.content)
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    indices.append(call.index)
                slot = calls.setdefault(call.index, ["", ""])
                if call.function is not None and call.function.name:
                    slot[0] += call.function.name
                if call.function is not None and call.function.arguments:
                    slot[1] += call.function.arguments
        return Parsed(
            "".join(reasoning) or None,
            "".join(content) or None,
            [(name, args) for _, (name, args) in sorted(calls.items())],
            chunks,
            issues_of(parser),
            indices,
        )
