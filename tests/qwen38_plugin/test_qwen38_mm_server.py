"""Stock vLLM's OpenAI server (`vllm serve`'s module, CPU) serving the tiny random
`Qwen4ExpForConditionalGeneration` through the portable multimodal model, asked with the `openai`
client: an image (PIL, sent as a base64 data URL) and a short MP4 video (made with OpenCV, which
vLLM's video loader decodes) give transformers' greedy tokens for the same conversation; corrupt
image bytes get HTTP 400 and the server keeps serving.

The tiny checkpoints' chat template renders text only, so the server runs with
`--chat-template-content-format string`: vLLM puts each medium's placeholder before the message's
text. transformers gets the same conversation (vLLM's own chat parser renders it and decodes the
media, as the server does) through its processor.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines import engine_cores
from tests.qwen38_plugin.mm_checkpoint import mm_model_checkpoint
from tests.qwen38_plugin.mm_inputs import hf_process, hf_run, load_hf_model, make_image

STEPS = 8
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-batched-tokens", "128",
               "--chat-template-content-format", "string"]  # fmt: skip


@pytest.fixture(scope="module")
def served(start_server: Callable[..., Any]) -> Iterator[tuple[Path, Any]]:
    model = mm_model_checkpoint()
    with engine_cores():
        server = start_server(model, SERVER_ARGS)
        try:
            yield model, server
        finally:
            server.stop()


def image_url(width: int, height: int, seed: int) -> str:
    buffer = io.BytesIO()
    make_image(width, height, seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def video_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-second MP4: 8 frames at 4 fps of 64 x 48, a noise image drifting right."""
    import cv2

    from tests.qwen38_plugin.mm_inputs import make_frames

    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 4.0, (64, 48))
    for frame in make_frames(8, 48, 64, 7):
        writer.write(frame[..., ::-1])  # OpenCV writes BGR
    writer.release()
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


def chat(server: Any, model: Path, messages: list[dict[str, Any]]) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=600)
    response = client.chat.completions.create(
        model=str(model), messages=messages, max_tokens=STEPS, temperature=0.0,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    dumped: dict[str, Any] = response.model_dump()
    return dumped


def transformers_answer(model: Path, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """transformers on the conversation as vLLM's chat parser renders it (placeholders before
    the text, media decoded by vLLM's loaders), greedy and without a cache."""
    from transformers import AutoProcessor
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.chat_utils import parse_chat_messages

    import qwen38_plugin

    qwen38_plugin.register()  # the multimodal defaults (16-frame video loader) the server applies
    config = EngineArgs(model=str(model), max_model_len=2048).create_engine_config()
    conversation, mm_data, _ = parse_chat_messages(messages, config.model_config, content_format="string")  # type: ignore[arg-type]
    processor = AutoProcessor.from_pretrained(model)
    text = processor.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    # vLLM's parser keeps each medium with its bytes (`MediaWithBytes`): the decoded medium is `.media`
    images, videos = ([getattr(item, "media", item) for item in mm_data.get(kind) or []] for kind in ("image", "video"))
    inputs = hf_process(processor, text, images, videos)
    return hf_run(load_hf_model(model), inputs, STEPS)


def user(*media: dict[str, Any], text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*media, {"type": "text", "text": text}]}]


def test_image_and_video_answers_equal_transformers(served: tuple[Path, Any], video_url: str) -> None:
    model, server = served
    messages = user(
        {"type": "image_url", "image_url": {"url": image_url(300, 200, 1)}},
        {"type": "video_url", "video_url": {"url": video_url}},
        text="What do the picture and the clip show?",
    )
    ours = chat(server, model, messages)
    theirs = transformers_answer(model, messages)
    assert ours["prompt_token_ids"] == theirs["prompt_token_ids"]
    assert ours["prompt_token_ids"].count(248056) > 0 and ours["prompt_token_ids"].count(248057) > 0
    assert ours["choices"][0]["token_ids"] == theirs["tokens"], server.log()[-3000:]
    assert "Qwen4ExpForConditionalGeneration: portable (qwen38_plugin) implementation (CPU platform)" in server.log()


def test_corrupt_image_gets_400_and_the_server_keeps_serving(served: tuple[Path, Any]) -> None:
    import openai

    model, server = served
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n not an image at all").decode()
    with pytest.raises(openai.BadRequestError) as raised:
        chat(server, model, user({"type": "image_url", "image_url": {"url": corrupt}}, text="What is this?"))
    assert raised.value.status_code == 400
    # still alive, and still right
    messages = user({"type": "image_url", "image_url": {"url": image_url(256, 320, 4)}}, text="And this one?")
    ours = chat(server, model, messages)
    assert ours["choices"][0]["token_ids"] == transformers_answer(model, messages)["tokens"]
