"""`kvpot serve` in a subprocess on a free loopback port, for the tests that drive it over HTTP
(tests/test_serve.py, tests/test_serve_abuse.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

MODEL = "kvpot-reference"
KEY = "test-key"
PASSKEY = "The pass key is 12345. Remember it. 12345 is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`python -m kvpot serve ...` in a subprocess; `stop()` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, state_dir: Path, *extra: str, key: str | None = KEY, launcher: list[str] | None = None,
                 extra_env: dict | None = None):
        """`launcher`: what runs `kvpot` (default `python -m kvpot`; torchrun for --tp); `extra_env`: added variables."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = state_dir.parent / f"server-{self.port}.log"
        self.key = key
        # one intra-op thread: on a shared 2-core machine two threads run a tiny model many times slower
        env = {k: v for k, v in os.environ.items() if k != "KVPOT_API_KEY"}
        env.update({"OMP_NUM_THREADS": "1", **({"KVPOT_API_KEY": key} if key else {})}, **(extra_env or {}))
        # InfiniPot with its default 2,048-entry pot: the reference model's window
        # KVPOT_SERVE_TEST_DEVICE=cuda runs the same tests on a GPU (batched steps as CUDA graphs)
        device = os.environ.get("KVPOT_SERVE_TEST_DEVICE", "cpu")
        argv = [*(launcher or [sys.executable, "-m", "kvpot"]), "serve", "--device", device, "--port", str(self.port),
                "--method", "infinipot",
                "--state-dir", str(state_dir), "--max-queue", "2", "--cache-min-tokens", "256",
                "--max-context-tokens", "40000", "--max-body-bytes", "1MiB", "--log-level", "warning", *extra]
        self.process = subprocess.Popen(argv, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvpot serve exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"kvpot serve did not start:\n{self.log.read_text()}")

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key or "unused", max_retries=0, timeout=300,
                             **kwargs)

    def http(self, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {**({"Authorization": f"Bearer {self.key}"} if self.key else {}), **kwargs.pop("headers", {})}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=300, **kwargs)

    def metric(self, name: str) -> float:
        for line in self.http("GET", "/metrics").text.splitlines():
            if line.startswith(f"kvpot_{name} "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


