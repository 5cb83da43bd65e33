"""The plugin registrations a stock vLLM server logs, read back from its log.

Each plugin's register() prints "<plugin> <version> registered in process <name> (pid <pid>):
<what>" through vLLM's logger (or to stderr before vLLM configures logging). The server tests
check them: tests/soak/test_soak.py (all five plugins, the default) and
tests/tool_parsers/test_tool_parsers_server.py (`VLLM_PLUGINS` naming two of them).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

PLUGINS = ("qwen38_plugin", "sm70_backend", "dflash2", "csf_loader", "tool_parsers")

REGISTRATION = re.compile(
    r"\b(?P<plugin>\w+) (?P<version>\d+\.\d+\.\d+) registered in process (?P<process>\S+) "
    r"\(pid (?P<pid>\d+)\): (?P<what>.*)$"
)

# On the CPU platform qwen38_plugin also takes over Qwen4Exp with its portable model.
QWEN38_ON_CPU = (
    "transformers config qwen3_8_flash_next_text, transformers config qwen3_8_flash_next, "
    "CPU seeded-sampling fix, CPU speculative-sampling expand fix, "
    "multimodal defaults for Qwen4ExpForConditionalGeneration, "
    "Qwen4ExpForConditionalGeneration dispatcher (the same rule), "
    "Qwen4ExpMTP dispatcher (the same rule), "
    "Qwen4ExpForCausalLM config hook (MTP draft buffer of hc * H), "
    "Qwen4ExpForConditionalGeneration config hook (MTP draft buffer of hc * H), "
    "portable Qwen4ExpForCausalLM (CPU platform)"
)


def registrations(log: str) -> dict[str, dict[int, tuple[str, str]]]:
    """plugin -> {pid: (process name, what it registered)}."""
    seen: dict[str, dict[int, tuple[str, str]]] = defaultdict(dict)
    for line in log.splitlines():
        match = REGISTRATION.search(line)
        if match:
            seen[match["plugin"]][int(match["pid"])] = (match["process"], match["what"])
    return seen


def assert_registered_in_every_process(server: Any, plugins: tuple[str, ...]) -> None:
    """Exactly `plugins` registered, each once in the API server, the engine core and the worker,
    the same in every process."""
    seen = registrations(server.log())
    assert sorted(seen) == sorted(plugins)
    api_server_pid = server.process.pid if server.process else -1
    for plugin in plugins:
        by_pid = seen[plugin]
        names = {name for name, _ in by_pid.values()}
        assert api_server_pid in by_pid, f"{plugin} did not register in the API server: {by_pid}"
        assert any(name.startswith("EngineCore") for name in names), f"{plugin}: no engine core in {names}"
        assert any(name.startswith("VllmWorker") for name in names), f"{plugin}: no worker in {names}"
        assert len(by_pid) == 3, by_pid  # once per process: register() is idempotent
        assert len({what for _, what in by_pid.values()}) == 1, by_pid  # the same in every process
    if "qwen38_plugin" in plugins:
        assert {what for _, what in seen["qwen38_plugin"].values()} == {QWEN38_ON_CPU}
