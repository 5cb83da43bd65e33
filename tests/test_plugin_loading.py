"""All five plugins load in a real stock vLLM server: API server, engine core and worker."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
from openai import OpenAI

from tools.vllm_server import VllmServer

PLUGINS = ("qwen38_plugin", "sm70_backend", "dflash2", "csf_loader", "tool_parsers")
# Eager mode: torch.compile adds ~20 s per start and is not what these tests are about.
SERVER_ARGS = ["--served-model-name", "tiny", "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager"]

# "<plugin> <version> registered in process <name> (pid <pid>): <what>", printed by each
# plugin's register() through vLLM's logger (or to stderr before vLLM configures logging).
REGISTRATION = re.compile(
    r"\b(?P<plugin>\w+) (?P<version>\d+\.\d+\.\d+) registered in process (?P<process>\S+) "
    r"\(pid (?P<pid>\d+)\): (?P<what>.*)$"
)


def registrations(log: str) -> dict[str, dict[int, tuple[str, str]]]:
    """plugin -> {pid: (process name, what it registered)}."""
    seen: dict[str, dict[int, tuple[str, str]]] = defaultdict(dict)
    for line in log.splitlines():
        match = REGISTRATION.search(line)
        if match:
            seen[match["plugin"]][int(match["pid"])] = (match["process"], match["what"])
    return seen


def chat(server: VllmServer) -> str:
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0.0
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"
    return reply.choices[0].message.content or ""


@pytest.fixture(scope="module")
def all_plugins_server(start_server, tiny_checkpoint) -> VllmServer:  # type: ignore[no-untyped-def]
    return start_server(tiny_checkpoint("qwen3"), SERVER_ARGS)


def test_chat_completion_through_openai_client(all_plugins_server: VllmServer) -> None:
    assert chat(all_plugins_server).strip()


def test_every_plugin_registers_in_api_server_engine_core_and_worker(all_plugins_server: VllmServer) -> None:
    seen = registrations(all_plugins_server.log())
    assert sorted(seen) == sorted(PLUGINS)
    api_server_pid = all_plugins_server.process.pid if all_plugins_server.process else -1
    for plugin in PLUGINS:
        by_pid = seen[plugin]
        names = {name for name, _ in by_pid.values()}
        assert api_server_pid in by_pid, f"{plugin} did not register in the API server: {by_pid}"
        assert any(name.startswith("EngineCore") for name in names), f"{plugin}: no engine core in {names}"
        assert any(name.startswith("VllmWorker") for name in names), f"{plugin}: no worker in {names}"
        assert len(by_pid) == 3, by_pid  # once per process: register() is idempotent
        assert len({what for _, what in by_pid.values()}) == 1, by_pid  # the same in every process
    # On the CPU platform qwen38_plugin also takes over Qwen4Exp with its portable model.
    qwen38_registered = {what for _, what in seen["qwen38_plugin"].values()}
    assert qwen38_registered == {
        "transformers config qwen3_8_flash_next_text, transformers config qwen3_8_flash_next, "
        "CPU seeded-sampling fix, multimodal defaults for Qwen4ExpForConditionalGeneration, "
        "Qwen4ExpForConditionalGeneration (stock's, encoder outputs owning their memory), "
        "portable Qwen4ExpForCausalLM (CPU platform)"
    }


def test_vllm_plugins_excludes_the_others(start_server, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    kept = ("qwen38_plugin", "tool_parsers")
    server = start_server(tiny_checkpoint("qwen3"), SERVER_ARGS, env={"VLLM_PLUGINS": ",".join(kept)})
    assert chat(server).strip()
    seen = registrations(server.log())
    assert sorted(seen) == sorted(kept)
    for plugin in kept:
        assert len(seen[plugin]) == 3
