"""The test and demo servers (tools/vllm_server.py) keep an idle HTTP connection open longer than
the openai and anthropic clients do, so a client never reuses a connection the server is closing.

With both at 5 s (stock vLLM's and httpx's defaults), a request sent on a connection idle for about
5 s can meet the server's close and fail with "Server disconnected without sending a response";
the server-level tests use ``max_retries=0``, so that fails the test (CI, 2026-12-03:
test_qwen38_mtp_server.py). This checks the setting reaches vLLM under the name it reads and that
it outlives each client's expiry."""

from __future__ import annotations

import anthropic._constants
import openai._constants
import pytest

from tools.vllm_server import CPU_ENV


@pytest.mark.parametrize("client", [openai._constants, anthropic._constants], ids=["openai", "anthropic"])
def test_the_server_keeps_idle_connections_longer_than_the_client(client: object) -> None:
    expiry = client.DEFAULT_CONNECTION_LIMITS.keepalive_expiry  # type: ignore[attr-defined]
    # None would mean the client never expires an idle connection: the race at any server timeout
    assert expiry is not None
    assert int(CPU_ENV["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) >= 2 * expiry


def test_vllm_reads_the_keep_alive_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.envs

    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", CPU_ENV["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"])
    assert "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" in vllm.envs.environment_variables
    seconds_read = vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    assert seconds_read == int(CPU_ENV["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"])
