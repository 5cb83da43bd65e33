"""Named behaviours of qwen38 / qwen38_coder, each checked streamed and non-streamed."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from tests.tool_parsers.qwen38_harness import Qwen38Harness, render_call
from tool_parsers.qwen38 import parse_parameters
from tool_parsers.request_context import JSON_ANSWER_KWARG, request_record
from tool_parsers.schema_refs import resolve_local_refs

WEATHER = render_call("get_weather", {"city": "Paris", "days": "3"})


# R01: an implicit end of reasoning


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": None, "response_format": {"type": "json_object"}},
        {"tool_choice": "none", "response_format": {"type": "json_object"}},
        {"tools": None, "structured_outputs": {"json": {"type": "object"}}},
    ],
)
def test_tool_call_marker_ends_reasoning_and_leaves_json_answer(harness: Qwen38Harness, fields: dict[str, Any]) -> None:
    # The middleware flags JSON-answer requests (its rule: test_json_answer_requests_are_flagged_for_the_engine).
    fields = {**fields, "chat_template_kwargs": {JSON_ANSWER_KWARG: True}}
    ids = harness.encode('Think first.<tool_call>{"a": 1}')
    for parsed in harness.parse_both(ids, fields, thinking=True):
        assert parsed.reasoning == "Think first."
        assert parsed.content == '{"a": 1}'
        assert parsed.calls == []


def test_tool_call_marker_ends_reasoning_and_starts_the_call(harness: Qwen38Harness) -> None:
    ids = harness.encode("Think first." + WEATHER)
    for choice in ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]:
        for parsed in harness.parse_both(ids, {"tool_choice": choice}, thinking=True):
            assert parsed.reasoning == "Think first."
            assert not parsed.content
            assert parsed.calls == [("get_weather", '{"city": "Paris", "days": 3}')]


# R06: tool_choice="none"


@pytest.mark.parametrize("thinking", [True, False])
def test_tool_choice_none_returns_markup_as_content(harness: Qwen38Harness, thinking: bool) -> None:
    answer = "Here: " + WEATHER
    ids = harness.encode(("ok\n</think>\n\n" if thinking else "") + answer)
    full, streamed = harness.parse_both(ids, {"tool_choice": "none"}, thinking)
    assert full.calls == streamed.calls == []
    assert full.content == streamed.content
    assert (full.content or "").strip() == answer


def test_tool_choice_none_does_not_hold_back_a_trailing_angle(harness: Qwen38Harness) -> None:
    ids = harness.encode("ok\n</think>\n\nif a <")
    _, streamed = harness.parse_both(ids, {"tool_choice": "none"}, thinking=True)
    last_text, last_content = streamed.chunks[-1]
    assert last_text.endswith("<")
    assert last_content == last_text
    # Every chunk after the reasoning comes back in the same chunk, unchanged.
    after = streamed.chunks[[t for t, _ in streamed.chunks].index("</think>") + 1 :]
    assert all(content == text for text, content in after)


# Bad input: unknown functions, schema mismatches, malformed markup


def test_unknown_function_is_dropped_and_named_in_a_warning(
    harness: Qwen38Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.plugins.tool_parsers.qwen38")
    text = render_call("delete_everything", {"path": "/"}) + "\n" + WEATHER
    for parsed in harness.parse_both(harness.encode(text), {"tool_choice": "auto"}, thinking=False):
        assert parsed.calls == [("get_weather", '{"city": "Paris", "days": 3}')]
        assert parsed.issues == [
            {"issue": "unknown_function", "action": "dropped_call", "index": 0, "name": "delete_everything"}
        ]
    assert any("'delete_everything'" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("chunking", ["token by token", "one chunk"])
def test_calls_after_dropped_ones_are_numbered_as_sent(harness: Qwen38Harness, chunking: str) -> None:
    """Streamed indices count the calls sent (clients fill their arrays by them); issues count every call written."""
    rome = render_call("get_weather", {"city": "Rome"})
    dropped = [render_call("delete_everything", {"path": "/"}), "<tool_call>\nhello\n</tool_call>"]
    text = "\n".join([dropped[0], WEATHER, dropped[1], rome])
    ids = harness.encode(text)
    fields = {"tool_choice": "auto"}
    full = harness.parse_full(ids, fields, thinking=False)
    streamed = harness.parse_stream(ids, range(1, len(ids)) if chunking == "token by token" else [], fields, False)
    expected_calls = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_weather", '{"city": "Rome"}')]
    assert full.calls == streamed.calls == expected_calls
    assert full.indices == streamed.indices == [0, 1]
    assert [(i["issue"], i["index"]) for i in streamed.issues] == [("unknown_function", 0), ("malformed", 2)]
    assert streamed.issues == full.issues


@pytest.mark.parametrize("days", ["a week", "3.5", "true"])
def test_value_not_matching_its_type_is_dropped_and_reported(harness: Qwen38Harness, days: str) -> None:
    # `days` is an integer; the valid argument stays, the other is left out and reported.
    text = render_call("get_weather", {"days": days, "city": "Oslo"})
    for parsed in harness.parse_both(harness.encode(text), {"tool_choice": "auto"}, thinking=False):
        assert parsed.arguments(0) == {"city": "Oslo"}
        (issue,) = parsed.issues
        assert (issue["issue"], issue["action"], issue["argument"]) == ("type_mismatch", "dropped_argument", "days")
        assert issue["expected"] == ["integer"]
        assert str(issue["value"]).lower() == days


@pytest.mark.parametrize(
    "markup",
    [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>",
        "<tool_call>\n<tool_call>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather\n</function>\n</tool_call>",
        "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>",
        "</parameter></function></tool_call><parameter=x>",
        "<tool_call>\nhello\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
    ],
)
@pytest.mark.parametrize("tool_choice", ["auto", "required", "none"])
def test_malformed_markup_never_raises_and_both_paths_agree(
    harness: Qwen38Harness, markup: str, tool_choice: str
) -> None:
    ids = harness.encode("Sure. " + markup)
    full, streamed = harness.parse_both(ids, {"tool_choice": tool_choice}, thinking=False)
    assert (full.content or None, full.calls) == (streamed.content or None, streamed.calls)
    assert full.issues == streamed.issues
    for name, _ in full.calls:
        assert name == "get_weather"
    # A <tool_call> block that yields no call is reported as dropped, never silently lost.
    if tool_choice != "none":
        blocks = markup.count("<tool_call>") - markup.count("<tool_call>\n<tool_call>")
        reported = [i for i in full.issues if i["action"] == "dropped_call"]
        assert len(full.calls) + len(reported) >= min(blocks, 1)
        assert all(i["issue"] == "malformed" and i["name"] is None for i in reported)


def test_whitespace_after_a_dropped_call_is_not_content(harness: Qwen38Harness) -> None:
    """As after a kept call, at any chunking and wherever the output ends (stock sent it at once
    when the chunk had no call deltas, which a dropped call never has)."""
    text = "Sure." + render_call("delete_everything", {"path": "/"}) + "\n" + WEATHER
    ids = harness.encode(text)
    after_blank = len(harness.encode(text[: text.index(WEATHER)]))
    for end in (after_blank, len(ids)):
        for cut in range(1, end):
            for parsed in (harness.parse_full(ids[:end], {}, False), harness.parse_stream(ids[:end], [cut], {}, False)):
                assert parsed.content == "Sure.", (end, cut)


# Values that contain the closing tags


@pytest.mark.parametrize(
    "content",
    [
        "x = '</function>'\ny = '</parameter>'\n</tool_call> stays",
        # The full terminator sequence inside a value: not followed by the end of the call.
        "a</parameter>\n</function>\nmore",
        "a</parameter>\n</function>",
        "a</parameter>\n</function></parameter>\n</function>b",
    ],
)
def test_literal_closing_tags_inside_a_string_value(harness: Qwen38Harness, content: str) -> None:
    text = render_call("write_file", {"path": "t.py", "content": content}) + "\n" + WEATHER
    for parsed in harness.parse_both(harness.encode(text), {"tool_choice": "auto"}, thinking=False):
        assert parsed.arguments(0) == {"path": "t.py", "content": content}
        assert parsed.calls[1] == ("get_weather", '{"city": "Paris", "days": 3}')
        assert parsed.issues == []


def test_terminator_followed_by_the_end_of_the_call_still_cuts_a_value(harness: Qwen38Harness) -> None:
    """The documented limit: `</parameter>`, `</function>`, `</tool_call>` in a row inside a value."""
    content = "a</parameter>\n</function>\n</tool_call> rest"
    text = render_call("write_file", {"path": "t.py", "content": content})
    full, streamed = harness.parse_both(harness.encode(text), {"tool_choice": "auto"}, thinking=False)
    assert full.calls == streamed.calls == [("write_file", '{"path": "t.py", "content": "a"}')]
    assert full.content == streamed.content


def test_parse_parameters_closes_a_value_only_before_a_tag() -> None:
    body = "\n<parameter=a>\n1</parameter>2\n</parameter>\n<parameter=b>\nz\n</parameter>\n"
    assert parse_parameters(body) == {"a": "1</parameter>2", "b": "z"}
    body = "\n<parameter=a>\n1</parameter>\n</function>\n2\n</parameter>\n"
    assert parse_parameters(body) == {"a": "1</parameter>\n</function>\n2"}
    assert parse_parameters("\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>") == {"a": "1"}
    assert parse_parameters("\n<parameter=a>\nop", partial=True) == {"a": "op"}
    assert parse_parameters("\n<parameter=a", partial=True) == {}


# Calls cut short by max_tokens


def test_call_cut_short_keeps_its_arguments_and_is_reported_to_the_request(harness: Qwen38Harness) -> None:
    text = WEATHER + "\n" + render_call("write_file", {"path": "notes.txt", "content": "long text"})
    ids = harness.encode(text)
    ids = ids[: len(harness.encode(text[: text.rindex("long") + 2]))]
    full, streamed = harness.parse_both(ids, {"tool_choice": "auto"}, thinking=False)
    assert full.calls == streamed.calls
    assert [name for name, _ in full.calls] == ["get_weather", "write_file"]
    assert full.arguments(1)["path"] == "notes.txt"
    assert full.issues == streamed.issues
    assert full.issues == [{"issue": "cut_short", "action": "kept_incomplete", "index": 1, "name": "write_file"}]
    # Inside an HTTP request (the middleware opens its record) the findings carry the cut call's id.
    with request_record("POST", "/v1/chat/completions") as record:
        parser, request = harness._new_parser(harness.request(), thinking=False)
        _, _, calls = parser.parse(harness.decode(ids), request, enable_auto_tools=True)
    assert [record.findings.is_cut_short(call.id) for call in calls] == [False, True]
    assert record.findings.issues() == full.issues


# Every tag the parser knows; the end of an output can cut any of them in two.
TAGS = (
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "<think>",
    "</think>",
)
CUT_CALLS = [("get_weather", {"city": "Paris", "days": "3"}), ("write_file", {"path": "a</b", "content": "x < y"})]
TYPES = {"city": str, "days": int, "path": str, "content": str}
# Each call's text up to its `</function>`: once that is written the call is complete.
FUNCTION_END_OF = {name: render_call(name, arguments).removesuffix("\n</tool_call>") for name, arguments in CUT_CALLS}


def without_cut_tag(text: str) -> str:
    """`text` without a trailing piece that may begin a tag (the README: a tag cut in two is markup)."""
    for start in range(len(text)):
        if any(tag.startswith(text[start:]) for tag in TAGS):
            return text[:start]
    return text


def expected_after_cut(text: str, written: str) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """The calls and issues the README gives when the output `text` ends after `written`.

    A call is complete once its `</function>` is written; one the end falls inside of
    is `cut_short`: dropped (`name`: what was written of it, or null) unless its name
    is one of the tools', else kept with each argument written so far (a string value
    as far as it was written, an integer once it has a digit).
    """
    calls: list[tuple[str, dict[str, Any]]] = []
    offset = len("Sure. ")
    for index, (name, arguments) in enumerate(CUT_CALLS):
        call_text = render_call(name, arguments)
        part = written[offset:]
        offset = text.index(call_text, offset) + len(call_text) + 1
        if not part.startswith("<tool_call>"):
            return calls, []  # not begun, or the marker itself cut: text, not a call
        typed = {key: TYPES[key](value) for key, value in arguments.items()}
        if FUNCTION_END_OF[name] in part:
            calls.append((name, typed))
            continue
        head = "<tool_call>\n<function="
        name_written = part[len(head) :].split(">")[0] if part.startswith(head) else ""
        if name_written != name:
            dropped = {"issue": "cut_short", "action": "dropped_call", "index": index, "name": name_written or None}
            return calls, [dropped]
        kept: dict[str, Any] = {}
        for key, value in arguments.items():
            opening = f"<parameter={key}>"
            if opening not in part:
                break
            start = part.index(opening) + len(opening) + 1  # the template's newline
            value_written = without_cut_tag(part[start : start + len(value)])
            if TYPES[key] is str:
                kept[key] = value_written
            elif value_written:
                kept[key] = TYPES[key](value_written)
        calls.append((name, kept))
        return calls, [{"issue": "cut_short", "action": "kept_incomplete", "index": index, "name": name}]
    return calls, []


@pytest.mark.parametrize("spelled", [False, True], ids=["marker tokens", "markers spelled"])
def test_a_cut_anywhere_is_reported_as_the_readme_says(harness: Qwen38Harness, spelled: bool) -> None:
    """Cut the output after every token: streamed and non-streamed give the README's calls and issues."""
    text = "Sure. " + "\n".join(render_call(name, arguments) for name, arguments in CUT_CALLS)
    ids = harness.encode_spelled(text) if spelled else harness.encode(text)
    for end in range(1, len(ids) + 1):
        written = harness.decode(ids[:end])
        calls, issues = expected_after_cut(text, written)
        for parsed in harness.parse_both(ids[:end], {"tool_choice": "auto"}, thinking=False):
            assert [(name, json.loads(arguments)) for name, arguments in parsed.calls] == calls, written
            assert parsed.issues == issues, written


def test_call_cut_inside_its_function_name_is_reported_dropped(harness: Qwen38Harness) -> None:
    text = "Sure. " + WEATHER
    ids = harness.encode(text)
    ids = ids[: len(harness.encode(text[: text.index("_weather")]))]
    full, streamed = harness.parse_both(ids, {"tool_choice": "auto"}, thinking=False)
    assert full.calls == streamed.calls == []
    assert full.issues == streamed.issues
    ((issue),) = full.issues
    assert (issue["issue"], issue["action"], issue["index"]) == ("cut_short", "dropped_call", 0)
    assert "get_weather".startswith(issue["name"] or "")


# $ref parameters


def test_ref_resolution_handles_both_def_locations_and_recursion() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"$ref": "#/$defs/N", "description": "kept"},
            "tree": {"$ref": "#/definitions/Tree"},
            "remote": {"$ref": "https://example.com/x.json"},
        },
        "$defs": {"N": {"type": "integer"}},
        "definitions": {"Tree": {"type": "object", "properties": {"child": {"$ref": "#/definitions/Tree"}}}},
    }
    resolved = resolve_local_refs(schema)
    assert resolved["properties"]["n"] == {"type": "integer", "description": "kept"}
    assert resolved["properties"]["tree"]["type"] == "object"
    # The recursive reference is expanded once and then left as a reference.
    assert resolved["properties"]["tree"]["properties"]["child"] == {"$ref": "#/definitions/Tree"}
    assert resolved["properties"]["remote"] == {"$ref": "https://example.com/x.json"}


def test_ref_typed_parameters_are_converted(harness: Qwen38Harness) -> None:
    text = render_call("set_limits", {"count": "7", "ratio": "1.5", "flags": '{"strict": true}'})
    for parsed in harness.parse_both(harness.encode(text), {"tool_choice": "auto"}, thinking=False):
        assert parsed.arguments(0) == {"count": 7, "ratio": 1.5, "flags": {"strict": True}}


def test_marker_spelled_with_ordinary_tokens_is_a_marker_in_both_paths(harness: Qwen38Harness) -> None:
    """xgrammar writes `<tool_call>` of a required / named call as ordinary text tokens."""
    pieces = ["<", "tool", "_call", ">\n", "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"]
    ids = [token for piece in pieces for token in harness.encode(piece)]
    assert harness.encode("<tool_call>")[0] not in ids
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        for parsed in harness.parse_both(ids, {"tool_choice": choice}, thinking=False):
            assert not parsed.content
            assert parsed.calls == [("get_weather", '{"city": "Paris"}')]
    # In the reasoning, it ends the reasoning, as the non-streamed parse always did.
    ids = harness.encode("Hm.") + ids
    for parsed in harness.parse_both(ids, {"tool_choice": "auto"}, thinking=True):
        assert parsed.reasoning == "Hm."
        assert parsed.calls == [("get_weather", '{"city": "Paris"}')]


def test_undefined_ref_is_rejected_naming_the_tool_and_the_fix(harness: Qwen38Harness) -> None:
    from vllm.exceptions import VLLMValidationError

    tools = [
        *harness.request().model_dump()["tools"],
        {
            "type": "function",
            "function": {"name": "broken", "parameters": {"properties": {"x": {"$ref": "#/$defs/X"}}}},
        },
    ]
    parser_cls = harness.parser_cls
    with pytest.raises(VLLMValidationError, match=r"tools\[3\] \('broken'\).*'#/\$defs/X'.*\$defs"):
        parser_cls(harness.tokenizer, None).adjust_request(harness.request(tools=tools))


def test_engine_shape_check_fails_loudly_when_vllm_changes() -> None:
    from tool_parsers.qwen38 import EXPECTED_VLLM_SHAPE, check_vllm_shape

    check_vllm_shape()  # the installed vLLM matches

    class Renamed:
        def _on_terminal(self, terminal: str, text: str) -> None: ...

    changed = {Renamed: {"_on_terminal": EXPECTED_VLLM_SHAPE[next(iter(EXPECTED_VLLM_SHAPE))]["_on_terminal"]}}
    changed[Renamed]["_emit_for_state"] = ("self", "text", "token_count")
    with pytest.raises(RuntimeError) as error:
        check_vllm_shape(changed)
    message = str(error.value)
    assert "Renamed._on_terminal('self', 'terminal', 'text')" in message
    assert "Renamed._emit_for_state is missing" in message
    assert "stock qwen3_coder" in message


def test_json_answer_flag_keeps_the_marker_out_of_the_grammar(harness: Qwen38Harness) -> None:
    """In the engine core, a `<tool_call>` that ended the reasoning is the grammar's first token,
    except for requests the middleware flagged as JSON answers (their grammar would reject it)."""
    from tool_parsers.qwen38 import Qwen38ReasoningParser

    ids = harness.encode('Hm.<tool_call>{"a": 1}')
    marker = harness.encode("<tool_call>")[0]
    plain = Qwen38ReasoningParser(harness.tokenizer, chat_template_kwargs={"enable_thinking": True})
    flagged = Qwen38ReasoningParser(
        harness.tokenizer, chat_template_kwargs={"enable_thinking": True, JSON_ANSWER_KWARG: True}
    )
    end = plain.find_reasoning_end(ids)
    assert end is not None and ids[end.offset] == marker and end.implicit
    assert flagged.find_reasoning_end(ids) == end._replace(implicit=False)
