"""A server we start is ready only when it is ours: /health is open to any server, so one that held
the port first (another job's, or another test's) must not be taken for ours. Against fake HTTP
servers in this process (no vLLM): one with another job's token refusing everything but /health,
one that checks no token but serves another model, and ours."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.rollout.auth import TOKEN_ENV
from megatron_rl.rollout.engines.server_process import ServerProcess
from megatron_rl.rollout.protocol import EngineUnavailable


def fake_server(token: str | None, model: str = "MODEL"):
    """A server answering /health to anyone and any other GET only with `token` (rollout/auth.py's
    rule; None: to anyone), listing `model` on /v1/models."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            allowed = (self.path == "/health" or token is None
                       or self.headers.get("Authorization") == f"Bearer {token}")
            body = (json.dumps({"data": [{"id": model}]}).encode() if allowed else b'{"error": "unauthorized"}')
            self.send_response(200 if allowed else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def waiting_process():
    """Stands in for our server while it starts: alive, answering nothing."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


REFUSED = {
    "another job's token": r"\(it refused this job's rollout token\)",
    "no token, another model": r"\(it serves \['/other/model'\], not /run/model\)",
}


@pytest.mark.parametrize("owner", [*REFUSED, "this job"])
def test_fake_server_on_the_port_is_ready_only_when_it_is_this_jobs(monkeypatch, tmp_path, waiting_process, owner):
    monkeypatch.setenv(TOKEN_ENV, "this-job")
    http = {"another job's token": lambda: fake_server("other-job", "/run/model"),
            "no token, another model": lambda: fake_server(None, "/other/model"),
            "this job": lambda: fake_server("this-job", "/run/model")}[owner]()
    try:
        url = f"http://127.0.0.1:{http.server_address[1]}"
        server = ServerProcess(waiting_process, url, tmp_path / "server.log", "vllm-0")
        if owner == "this job":
            server.wait_ready(timeout_s=10, served_model="/run/model")
            return
        with pytest.raises(EngineUnavailable, match=r"another server already listens at http://127\.0\.0\.1:\d+ "
                                                    + REFUSED[owner]):
            server.wait_ready(timeout_s=10, served_model="/run/model")
    finally:
        http.shutdown()
        http.server_close()
