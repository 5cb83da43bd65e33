"""A seeded, bounded soak load against a running vLLM OpenAI-compatible server.

Nothing here starts a server: `run_soak(SoakConfig(base_url=..., ...))` drives whichever
server the URL names (the CPU test server of `test_soak.py`, or a GPU server later, through
`python -m tests.soak.run --url ...`). Everything goes to that URL only.

The load (`build_workload`, one `random.Random(seed)`):

* `completion`: `/v1/completions` with token-id prompts, short (1-40 tokens) or long (a third
  of to all of `long`: 60% of what `max_model_len` leaves after the answer, at most
  `long_prompt_tokens`), some with long outputs (up to `long_output_tokens`);
* `chat` and `messages`: multi-turn conversations through the `openai` and `anthropic`
  clients. Every turn of a conversation is a request of its own whose prompt extends the
  previous turn's, and the conversations share a few system prompts, one of them long: the
  requests share prefixes, so the prefix cache has something to hit;
* `chat_tools` / `messages_tools`: tool calls. With `forced_output` the server has the
  test-support logits processor (`tests/tool_parsers/forced_output.py`) and each request
  forces a rendered call (one or two), which the parsers turn into tool calls; without it
  the model decides;
* `chat_grammar`: strict tools with `tool_choice="required"` (an xgrammar structural tag per
  request);
* `chat_n`: `n` of 2 to 4, sampled with a per-request `seed`;
* `repeat`: an earlier request sent again, unchanged;
* `cancel`: a stream read for one to three chunks, then closed;
* `disconnect`: a raw HTTP request written to a socket that is closed without reading.

Two passes. The reference pass sends every compared request alone, one at a time, with a
`cache_salt` of its own, so that it can neither hit nor leave a prefix for another request:
what each request returns when alone. The soak pass then sends every request (cancelled and
disconnecting ones too, no salts), up to `concurrency` at once in a seeded order, while
`/health` and `/metrics` are polled. Each compared request must return exactly its reference:
token ids (`return_token_ids`) with text, reasoning, tool calls and finish reasons for the
OpenAI APIs; the content blocks and stop reason for `/v1/messages`. Sampled requests
(`chat_n`) compare too: vLLM seeds each choice from the request's seed.

Before and after the soak pass the server is settled (`settle`): the driver waits for its
own requests, then sends a one-token probe request until vLLM's metrics show no request
running or waiting, and reads `vllm:kv_cache_usage_perc`. vLLM's hybrid cache keeps the
model's KV blocks and its recurrent-state (GDN / PLE) slots in one block pool, so this one
gauge covers both; after the load it must be back at its idle value.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anthropic
import httpx
import openai

from tests.tool_definitions import GET_WEATHER, WRITE_FILE
from tools.token_compare import first_difference

FORCED_IDS_KEY = "forced_token_ids"  # tests/tool_parsers/forced_output.py

# Tools without `strict`: no grammar, so a forced call reaches the parser as written.
CHAT_TOOLS: list[dict[str, Any]] = [GET_WEATHER, WRITE_FILE]
# Strict tools: `tool_choice="required"` compiles a grammar for them.
STRICT_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "set_level",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"level": {"type": "integer", "enum": [1, 2]}, "loud": {"type": "boolean"}},
                "required": ["level", "loud"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "ping", "strict": True, "parameters": {"type": "object", "properties": {}}},
    },
]
MESSAGES_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in CHAT_TOOLS
]
NO_THINKING = {"enable_thinking": False}

COMPARED_KINDS = ("completion", "chat", "chat_tools", "chat_grammar", "chat_n", "messages", "messages_tools")
# kind -> weight in the mix (repeat, cancel and disconnect are added on top)
MIX: dict[str, float] = {
    "completion": 0.20,
    "chat": 0.24,
    "chat_tools": 0.09,
    "chat_grammar": 0.05,
    "chat_n": 0.09,
    "messages": 0.14,
    "messages_tools": 0.05,
    "repeat": 0.05,
    "cancel": 0.06,
    "disconnect": 0.03,
}


@dataclass
class SoakConfig:
    base_url: str
    model: str | None = None  # default: the server's first model
    requests: int = 40
    concurrency: int = 8
    seed: int = 0
    max_tokens: int = 24  # upper bound of each compared request's max_tokens
    long_prompt_tokens: int = 800  # cap on "long" prompts (also bounded by max_model_len)
    long_output_tokens: int = 160  # upper bound of the long outputs some completions ask for
    forced_output: bool = True  # the server loads tests/tool_parsers/forced_output.py
    reference_url: str | None = None  # a second, fresh server for the reference pass
    request_timeout: float = 600.0
    settle_timeout: float = 300.0
    health_interval: float = 0.5


@dataclass
class Job:
    index: int
    kind: str
    api: str  # "completions" | "chat" | "messages" | "raw"
    stream: bool
    body: dict[str, Any]
    compared: bool = True
    cancel_after: int = 0  # cancel: chunks read before the stream is closed
    copy_of: int | None = None  # repeat: the job whose body this is


@dataclass
class Sent:
    """One request as sent in one pass."""

    job: int
    ok: bool
    outcome: Any = None
    error: str = ""
    seconds: float = 0.0
    chunks: int = 0


@dataclass
class Mismatch:
    job: int
    kind: str
    detail: str


@dataclass
class SoakReport:
    requests: int
    compared: int
    kinds: dict[str, int]
    streamed: int
    concurrency: int
    peak_in_flight: int
    reference_seconds: float
    soak_seconds: float
    mismatches: list[Mismatch]
    errors: list[str]
    health_checks: int
    health_failures: list[str]
    health_max_seconds: float
    metrics_delta: dict[str, float]
    peak_running: float
    peak_waiting: float
    peak_kv_usage: float
    kv_idle_before: float | None
    kv_idle_after: float | None
    cancelled_chunks: list[int] = field(default_factory=list)

    @property
    def preemptions(self) -> float:
        return self.metrics_delta.get("vllm:num_preemptions_total", 0.0)

    @property
    def prefix_hits(self) -> float:
        return self.metrics_delta.get("vllm:prefix_cache_hits_total", 0.0)

    def problems(self) -> list[str]:
        """Everything that makes the soak fail; empty when it passed."""
        out = [f"request {m.job} ({m.kind}): {m.detail}" for m in self.mismatches]
        out += self.errors
        out += [f"/health: {f}" for f in self.health_failures]
        if self.kv_idle_before is None or self.kv_idle_after is None:
            out.append("vllm:kv_cache_usage_perc not in /metrics (is --disable-log-stats set?)")
        elif self.kv_idle_after != self.kv_idle_before:
            out.append(
                f"KV cache usage did not return to idle: {self.kv_idle_after:.6f} after the load, "
                f"{self.kv_idle_before:.6f} before (leaked blocks or state slots)"
            )
        return out

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["preemptions"] = self.preemptions
        data["prefix_hits"] = self.prefix_hits
        data["problems"] = self.problems()
        return data

    def summary(self) -> str:
        delta = self.metrics_delta
        lines = [
            f"soak: {self.requests} requests ({self.compared} compared with their solo reference), "
            f"{self.streamed} streamed, up to {self.concurrency} at once (peak in flight {self.peak_in_flight}), "
            f"soak pass {self.soak_seconds:.1f} s, reference pass {self.reference_seconds:.1f} s",
            "  kinds: " + ", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items())),
            f"  engine: preemptions {self.preemptions:g}, prefix cache hits {self.prefix_hits:g} of "
            f"{delta.get('vllm:prefix_cache_queries_total', 0.0):g} queried tokens, "
            f"peak running {self.peak_running:g} / waiting {self.peak_waiting:g}, "
            f"peak KV usage {self.peak_kv_usage:.1%}",
            f"  KV usage idle before {self.kv_idle_before} / after {self.kv_idle_after}",
            f"  /health: {self.health_checks} checks, {len(self.health_failures)} failed, "
            f"slowest {self.health_max_seconds:.2f} s",
            f"  mismatches {len(self.mismatches)}, errors {len(self.errors)}",
        ]
        if self.cancelled_chunks:
            lines.append(
                f"  cancelled {len(self.cancelled_chunks)} streams after {min(self.cancelled_chunks)}-"
                f"{max(self.cancelled_chunks)} chunks, {self.kinds.get('disconnect', 0)} clients disconnected "
                f"without reading (vLLM logs aborts only with --enable-log-requests)"
            )
        lines += [f"  PROBLEM {p}" for p in self.problems()[:20]]
        return "\n".join(lines)


# ── server facts ─────────────────────────────────────────────────────────────


@dataclass
class ServerInfo:
    model: str
    max_model_len: int


async def server_info(http: httpx.AsyncClient, model: str | None) -> ServerInfo:
    response = await http.get("/v1/models")
    response.raise_for_status()
    models = response.json()["data"]
    chosen = next((m for m in models if m["id"] == model), None) if model else models[0]
    if chosen is None:
        raise ValueError(f"model {model!r} not served; the server has {[m['id'] for m in models]}")
    return ServerInfo(chosen["id"], int(chosen.get("max_model_len") or 2048))


async def tokenize(http: httpx.AsyncClient, model: str, text: str) -> list[int]:
    response = await http.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
    response.raise_for_status()
    return list(response.json()["tokens"])


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: unlabelled totals per metric name, plus request_success per finished_reason."""
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            number = float(value)
        except ValueError:
            continue
        out[name] += number
        if name == "vllm:request_success_total" and 'finished_reason="' in name_labels:
            reason = name_labels.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[f'{name}{{finished_reason="{reason}"}}'] += number
    return dict(out)


async def metrics(http: httpx.AsyncClient) -> dict[str, float]:
    response = await http.get("/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


# ── the workload ─────────────────────────────────────────────────────────────


def render_call(name: str, arguments: dict[str, str]) -> str:
    """A call in the Qwen3-coder XML format, as the chat template renders it."""
    params = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


class _Words:
    SYLLABLES = ("ka", "lo", "mi", "ter", "an", "sul", "bri", "do", "ve", "xu", "pol", "ra", "ne", "ost", "gri", "em")

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.vocab = ["".join(rng.choice(self.SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(400)]

    def text(self, words: int) -> str:
        return " ".join(self.rng.choice(self.vocab) for _ in range(max(1, words)))


async def build_workload(config: SoakConfig, info: ServerInfo, http: httpx.AsyncClient) -> list[Job]:
    """`config.requests` jobs, the same for the same seed, server model and max_model_len."""
    rng = random.Random(config.seed)
    words = _Words(rng)
    probe = words.text(200)
    tokens_per_word = max(1.0, len(await tokenize(http, info.model, probe)) / 200)
    token_pool = sorted(set(await tokenize(http, info.model, words.text(600))))
    # Room for the chat template and the answer: prompts stay under max_model_len.
    budget = info.max_model_len - config.max_tokens - 64
    long_tokens = max(64, min(config.long_prompt_tokens, int(budget * 0.6)))

    def words_for(tokens: int) -> int:
        return max(1, int(tokens / tokens_per_word / 1.3))

    systems = [words.text(words_for(long_tokens // 2)), words.text(40), words.text(12)]
    conversations: list[tuple[int, list[tuple[str, str]]]] = []
    for c in range(max(3, config.requests // 10)):
        turns = [(words.text(rng.randint(3, 30)), words.text(rng.randint(5, 40))) for _ in range(4)]
        conversations.append((c % len(systems), turns))

    def conversation(depth_max: int = 4) -> tuple[str, list[dict[str, str]]]:
        system, turns = rng.choice(conversations)
        depth = rng.randint(0, depth_max - 1)
        messages: list[dict[str, str]] = []
        for user, assistant in turns[:depth]:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        messages.append({"role": "user", "content": turns[depth][0]})
        return systems[system], messages

    def max_tokens() -> int:
        return rng.randint(4, config.max_tokens)

    async def forced_call(n_calls: int) -> tuple[list[int], str]:
        calls = []
        for _ in range(n_calls):
            if rng.random() < 0.6:
                args = {"city": words.text(rng.randint(1, 3)).title()}
                if rng.random() < 0.5:
                    args["days"] = str(rng.randint(1, 9))
                calls.append(render_call("get_weather", args))
            else:
                calls.append(render_call("write_file", {"path": f"/tmp/{words.text(1)}.txt", "content": words.text(6)}))
        text = "\n".join(calls)
        return await tokenize(http, info.model, text), text

    jobs: list[Job] = []
    kinds = list(MIX)
    weights = [MIX[k] for k in kinds]
    while len(jobs) < config.requests:
        index = len(jobs)
        kind = rng.choices(kinds, weights)[0]
        stream = rng.random() < 0.5
        if kind == "repeat":
            earlier = [j for j in jobs if j.compared and j.copy_of is None]
            if not earlier:
                continue
            source = rng.choice(earlier)
            jobs.append(Job(index, source.kind, source.api, source.stream, source.body, copy_of=source.index))
            continue
        if kind == "completion":
            length = rng.randint(1, 40) if rng.random() < 0.6 else rng.randint(long_tokens // 3, long_tokens)
            prompt = [rng.choice(token_pool) for _ in range(length)]
            # some long outputs: decoding requests that grow into new KV blocks while others wait
            tokens = rng.randint(config.long_output_tokens // 2, config.long_output_tokens)
            tokens = min(tokens, info.max_model_len - length - 1) if rng.random() < 0.4 else max_tokens()
            body: dict[str, Any] = {"prompt": prompt, "max_tokens": tokens, "temperature": 0}
            body["return_token_ids"] = True
            jobs.append(Job(index, kind, "completions", stream, body))
        elif kind in ("chat", "chat_n"):
            system, messages = conversation()
            body = {
                "messages": [{"role": "system", "content": system}, *messages],
                "max_tokens": max_tokens(),
                "return_token_ids": True,
                "chat_template_kwargs": {"enable_thinking": rng.random() < 0.5},
            }
            if kind == "chat_n":
                body.update(n=rng.randint(2, 4), temperature=0.8, top_p=0.95, seed=rng.randint(0, 2**31))
            else:
                body["temperature"] = 0
            jobs.append(Job(index, kind, "chat", stream, body))
        elif kind == "chat_tools":
            _, messages = conversation(2)
            body = {"messages": messages, "tools": CHAT_TOOLS, "temperature": 0, "return_token_ids": True}
            body["chat_template_kwargs"] = NO_THINKING
            if config.forced_output:
                ids, _ = await forced_call(rng.choice((1, 1, 2)))
                body.update(max_tokens=len(ids) + 2, vllm_xargs={FORCED_IDS_KEY: ids})
            else:
                body["max_tokens"] = max_tokens()
            jobs.append(Job(index, kind, "chat", stream, body))
        elif kind == "chat_grammar":
            _, messages = conversation(2)
            body = {
                "messages": messages,
                "tools": STRICT_TOOLS,
                "tool_choice": "required",
                "temperature": 0,
                "max_tokens": config.max_tokens + 16,
                "return_token_ids": True,
                "chat_template_kwargs": NO_THINKING,
            }
            jobs.append(Job(index, kind, "chat", stream, body))
        elif kind in ("messages", "messages_tools"):
            system, messages = conversation(2 if kind == "messages_tools" else 4)
            body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens()}
            if kind == "messages":
                body["system"] = system
                body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
            else:
                body.update(tools=MESSAGES_TOOLS, chat_template_kwargs=NO_THINKING)
                if config.forced_output:
                    ids, _ = await forced_call(1)
                    body.update(max_tokens=len(ids) + 2, vllm_xargs={FORCED_IDS_KEY: ids})
            jobs.append(Job(index, kind, "messages", stream, body))
        elif kind == "cancel":
            _, messages = conversation()
            body = {"messages": messages, "max_tokens": config.max_tokens * 8, "temperature": 0, "ignore_eos": True}
            jobs.append(Job(index, kind, "chat", True, body, compared=False, cancel_after=rng.randint(1, 3)))
        else:  # disconnect
            length = rng.randint(1, long_tokens)
            prompt = [rng.choice(token_pool) for _ in range(length)]
            body = {"prompt": prompt, "max_tokens": config.max_tokens * 4, "temperature": 0, "ignore_eos": True}
            jobs.append(Job(index, kind, "raw", stream, body, compared=False))
    return jobs


# ── sending one request ──────────────────────────────────────────────────────


def _outcome_from_choices(choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        message = choice.get("message") or {}
        calls = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []
            if c.get("function")
        ]
        out.append(
            {
                "tokens": choice.get("token_ids"),
                "text": choice.get("text", message.get("content")) or "",
                "reasoning": message.get("reasoning") or "",
                "tool_calls": calls,
                "finish": choice.get("finish_reason"),
            }
        )
    return out


class _StreamedChoices:
    """Joins streamed chat / completion chunks per choice index."""

    def __init__(self) -> None:
        self.choices: dict[int, dict[str, Any]] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or []:
            slot = self.choices.setdefault(
                int(choice.get("index", 0)),
                {"tokens": [], "text": "", "reasoning": "", "calls": {}, "finish": None},
            )
            slot["tokens"] += choice.get("token_ids") or []
            delta = choice.get("delta") or {}
            slot["text"] += choice.get("text") or delta.get("content") or ""
            slot["reasoning"] += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                entry = slot["calls"].setdefault(call.get("index", 0), ["", ""])
                function = call.get("function") or {}
                entry[0] += function.get("name") or ""
                entry[1] += function.get("arguments") or ""
            slot["finish"] = choice.get("finish_reason") or slot["finish"]

    def outcome(self) -> list[dict[str, Any]]:
        return [
            {
                "tokens": slot["tokens"],
                "text": slot["text"],
                "reasoning": slot["reasoning"],
                "tool_calls": [tuple(v) for _, v in sorted(slot["calls"].items())],
                "finish": slot["finish"],
            }
            for _, slot in sorted(self.choices.items())
        ]


def _message_outcome(message: Any) -> dict[str, Any]:
    blocks: list[tuple[Any, ...]] = []
    for block in message.content:
        if block.type == "text":
            blocks.append(("text", block.text))
        elif block.type == "thinking":
            blocks.append(("thinking", block.thinking))  # the signature differs per request
        elif block.type == "tool_use":
            blocks.append(("tool_use", block.name, json.dumps(block.input, sort_keys=True)))
        else:
            blocks.append((block.type,))
    return {"content": blocks, "stop_reason": message.stop_reason}


class Sender:
    """Sends jobs with the `openai` and `anthropic` clients (raw sockets for disconnects)."""

    def __init__(self, base_url: str, model: str, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.openai = openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="soak", max_retries=0, timeout=timeout)
        self.anthropic = anthropic.AsyncAnthropic(
            base_url=self.base_url, api_key="soak", max_retries=0, timeout=timeout
        )

    async def close(self) -> None:
        await self.openai.close()
        await self.anthropic.close()

    async def send(self, job: Job, salt: str | None = None) -> Sent:
        start = time.monotonic()
        body = dict(job.body)
        if salt is not None:
            body["cache_salt"] = salt
        try:
            if job.api == "raw":
                await self._disconnect(job, body)
                return Sent(job.index, True, seconds=time.monotonic() - start)
            if job.kind == "cancel":
                chunks = await self._cancel(job, body)
                return Sent(job.index, True, seconds=time.monotonic() - start, chunks=chunks)
            if job.api == "messages":
                outcome: Any = await self._messages(job, body)
            else:
                outcome = await self._openai(job, body)
            return Sent(job.index, True, outcome, seconds=time.monotonic() - start)
        except Exception as error:  # every failure is reported against its request
            return Sent(
                job.index, False, error=f"{type(error).__name__}: {error}"[:500], seconds=time.monotonic() - start
            )

    async def _openai(self, job: Job, body: dict[str, Any]) -> list[dict[str, Any]]:
        if job.api == "completions":
            prompt = body.pop("prompt")
            if not job.stream:
                response = await self.openai.completions.create(model=self.model, prompt=prompt, extra_body=body)
                return _outcome_from_choices(response.model_dump()["choices"])
            completion_stream = await self.openai.completions.create(
                model=self.model, prompt=prompt, stream=True, extra_body=body
            )
            joined = _StreamedChoices()
            async for chunk in completion_stream:
                joined.add(chunk.model_dump())
            return joined.outcome()
        messages = body.pop("messages")
        if not job.stream:
            chat = await self.openai.chat.completions.create(model=self.model, messages=messages, extra_body=body)
            return _outcome_from_choices(chat.model_dump()["choices"])
        chat_stream = await self.openai.chat.completions.create(
            model=self.model, messages=messages, stream=True, extra_body=body
        )
        joined = _StreamedChoices()
        async for chat_chunk in chat_stream:
            joined.add(chat_chunk.model_dump())
        return joined.outcome()

    async def _messages(self, job: Job, body: dict[str, Any]) -> dict[str, Any]:
        messages, max_tokens = body.pop("messages"), body.pop("max_tokens")
        if not job.stream:
            message = await self.anthropic.messages.create(
                model=self.model, max_tokens=max_tokens, messages=messages, extra_body=body
            )
            return _message_outcome(message)
        async with self.anthropic.messages.stream(
            model=self.model, max_tokens=max_tokens, messages=messages, extra_body=body
        ) as stream:
            return _message_outcome(await stream.get_final_message())

    async def _cancel(self, job: Job, body: dict[str, Any]) -> int:
        messages = body.pop("messages")
        stream = await self.openai.chat.completions.create(
            model=self.model, messages=messages, stream=True, extra_body=body
        )
        chunks = 0
        try:
            async for _ in stream:
                chunks += 1
                if chunks >= job.cancel_after:
                    break
        finally:
            await stream.close()  # closes the HTTP response mid-stream
        return chunks

    async def _disconnect(self, job: Job, body: dict[str, Any]) -> None:
        url = urlsplit(self.base_url)
        payload = json.dumps({"model": self.model, "stream": job.stream, **body}).encode()
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        _, writer = await asyncio.open_connection(url.hostname, url.port or 80)
        writer.write(request)
        await writer.drain()
        await asyncio.sleep(0.05)  # long enough for the server to start the request
        writer.close()  # without reading a byte
        with contextlib.suppress(OSError):
            await writer.wait_closed()


# ── comparing ────────────────────────────────────────────────────────────────


def difference(reference: Any, got: Any) -> str | None:
    """Where `got` first differs from `reference`; None when equal."""
    if reference == got:
        return None
    if isinstance(reference, list) and isinstance(got, list) and len(reference) == len(got):
        for index, (a, b) in enumerate(zip(reference, got, strict=True)):
            if a == b:
                continue
            if isinstance(a, dict) and isinstance(b, dict):
                ta, tb = a.get("tokens") or [], b.get("tokens") or []
                if ta != tb:
                    first = first_difference(ta, tb)
                    assert first is not None  # the lists differ
                    return (
                        f"choice {index}: tokens differ from position {first} (reference "
                        f"{ta[first : first + 4]}... of {len(ta)}, got {tb[first : first + 4]}... of {len(tb)})"
                    )
                keys = [k for k in a if a.get(k) != b.get(k)]
                mine, theirs = [a[k] for k in keys], [b.get(k) for k in keys]
                return f"choice {index}: {', '.join(keys)} differ: reference {mine!r:.300} got {theirs!r:.300}"
            return f"choice {index}: reference {a!r:.300} got {b!r:.300}"
    return f"reference {reference!r:.400} got {got!r:.400}"


# ── the passes ───────────────────────────────────────────────────────────────


class _Poller:
    """Polls /health and /metrics until stopped; any /health that is not 200 is a failure."""

    def __init__(self, http: httpx.AsyncClient, interval: float) -> None:
        self.http = http
        self.interval = interval
        self.checks = 0
        self.failures: list[str] = []
        self.slowest = 0.0
        self.peak = {
            "vllm:num_requests_running": 0.0,
            "vllm:num_requests_waiting": 0.0,
            "vllm:kv_cache_usage_perc": 0.0,
        }
        self._stop = asyncio.Event()

    async def run(self) -> None:
        tick = 0
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                response = await self.http.get("/health", timeout=60)
                if response.status_code != 200:
                    self.failures.append(f"HTTP {response.status_code} at check {self.checks}")
            except httpx.HTTPError as error:
                self.failures.append(f"{type(error).__name__} at check {self.checks}: {error}")
            self.checks += 1
            self.slowest = max(self.slowest, time.monotonic() - start)
            if tick % 2 == 0:
                with contextlib.suppress(httpx.HTTPError):
                    values = await metrics(self.http)
                    for key in self.peak:
                        self.peak[key] = max(self.peak[key], values.get(key, 0.0))
            tick += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval)

    def stop(self) -> None:
        self._stop.set()


async def settle(http: httpx.AsyncClient, model: str, token: int, timeout: float, tag: str) -> float | None:
    """Wait until vLLM runs no request, then return its KV cache usage (None without metrics).

    vLLM publishes these gauges with each engine step, so a request aborted while nothing
    else runs leaves them stale; a one-token probe request (with its own cache_salt) makes
    a step, whose stats are taken after the finished and aborted requests were freed.
    """
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        attempt += 1
        body = {"model": model, "prompt": [token], "max_tokens": 1, "temperature": 0, "cache_salt": f"{tag}-{attempt}"}
        (await http.post("/v1/completions", json=body, timeout=120)).raise_for_status()
        values = await metrics(http)
        if "vllm:kv_cache_usage_perc" not in values:
            return None
        if values.get("vllm:num_requests_running", 0) == 0 and values.get("vllm:num_requests_waiting", 0) == 0:
            return values["vllm:kv_cache_usage_perc"]
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM still runs requests {timeout:.0f} s after the load ended: {values}")
        await asyncio.sleep(1.0)


async def run_soak(config: SoakConfig, log: Callable[[str], None] = print) -> SoakReport:
    """Build the workload, run the reference and soak passes, and report (see the module docstring)."""
    # The client shares its process with whatever ran before it (under pytest: torch, vLLM and
    # transformers objects of earlier tests). A full garbage collection over that heap can stop
    # this event loop for seconds between a request's headers and its body, which the server
    # rightly answers 408 (CI, 2026-12-01: four requests); frozen objects are not scanned.
    gc.collect()
    gc.freeze()
    try:
        return await _run_soak(config, log)
    finally:
        gc.unfreeze()


async def _run_soak(config: SoakConfig, log: Callable[[str], None]) -> SoakReport:
    limits = httpx.Limits(max_connections=8)
    async with httpx.AsyncClient(base_url=config.base_url, timeout=120, limits=limits) as http:
        info = await server_info(http, config.model)
        jobs = await build_workload(config, info, http)
        probe_token = (await tokenize(http, info.model, "soak"))[0]
        log(f"soak: {len(jobs)} requests for {info.model} (max_model_len {info.max_model_len}), seed {config.seed}")

        reference_sender = Sender(config.reference_url or config.base_url, info.model, config.request_timeout)
        sender = Sender(config.base_url, info.model, config.request_timeout)
        try:
            # 1. each compared request alone, one at a time, isolated by its own cache_salt
            start = time.monotonic()
            reference: dict[int, Sent] = {}
            for job in jobs:
                if job.compared:
                    reference[job.index] = await reference_sender.send(job, salt=f"soak-ref-{config.seed}-{job.index}")
            reference_seconds = time.monotonic() - start
            log(f"soak: reference pass {reference_seconds:.1f} s")
            idle_before = await settle(http, info.model, probe_token, config.settle_timeout, "soak-idle-before")
            before = await metrics(http)

            # 2. everything at once, up to `concurrency` in flight, in a seeded order
            order = list(jobs)
            random.Random(config.seed + 1).shuffle(order)
            gate = asyncio.Semaphore(config.concurrency)
            in_flight = 0
            peak_in_flight = 0

            async def one(job: Job) -> Sent:
                nonlocal in_flight, peak_in_flight
                async with gate:
                    in_flight += 1
                    peak_in_flight = max(peak_in_flight, in_flight)
                    try:
                        return await sender.send(job)
                    finally:
                        in_flight -= 1

            poller = _Poller(http, config.health_interval)
            polling = asyncio.create_task(poller.run())
            start = time.monotonic()
            results: list[Sent] = await asyncio.gather(*(one(job) for job in order))
            soak_seconds = time.monotonic() - start
            idle_after = await settle(http, info.model, probe_token, config.settle_timeout, "soak-idle-after")
            poller.stop()
            await polling
            after = await metrics(http)
        finally:
            await sender.close()
            await reference_sender.close()

    by_index = {job.index: job for job in jobs}
    mismatches: list[Mismatch] = []
    errors: list[str] = []
    for job_index, sent in sorted(reference.items()):
        if not sent.ok:
            errors.append(f"request {job_index} ({by_index[job_index].kind}) failed alone: {sent.error}")
    for sent in results:
        job = by_index[sent.job]
        if not sent.ok:
            errors.append(f"request {sent.job} ({job.kind}) failed under load: {sent.error}")
        elif job.compared and reference[job.index].ok:
            detail = difference(reference[job.index].outcome, sent.outcome)
            if detail:
                mismatches.append(Mismatch(job.index, job.kind, detail))
    kinds: dict[str, int] = defaultdict(int)
    for job in jobs:
        kinds["repeat" if job.copy_of is not None else job.kind] += 1
    watched = (
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
    )
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in watched}
    return SoakReport(
        requests=len(jobs),
        compared=sum(job.compared for job in jobs),
        kinds=dict(kinds),
        streamed=sum(job.stream for job in jobs),
        concurrency=config.concurrency,
        peak_in_flight=peak_in_flight,
        reference_seconds=reference_seconds,
        soak_seconds=soak_seconds,
        mismatches=mismatches,
        errors=errors,
        health_checks=poller.checks,
        health_failures=poller.failures,
        health_max_seconds=poller.slowest,
        metrics_delta=delta,
        peak_running=poller.peak["vllm:num_requests_running"],
        peak_waiting=poller.peak["vllm:num_requests_waiting"],
        peak_kv_usage=poller.peak["vllm:kv_cache_usage_perc"],
        kv_idle_before=idle_before,
        kv_idle_after=idle_after,
        cancelled_chunks=[s.chunks for s in results if by_index[s.job].kind == "cancel"],
    )


def run(config: SoakConfig, log: Callable[[str], None] = print) -> SoakReport:
    return asyncio.run(run_soak(config, log))
