"""A server we start is ready only when it is ours: /health is open to any server, so one that held
the port first (another job's, or another test's) must not be taken for ours. Against fake HTTP
servers in this process (no vLLM): one with our token's middleware refusing everything but
/health, one answering both routes."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.rollout.auth import TOKEN_ENV
from megatron_rl.rollout.engines.server_process import ServerProcess
from megatron_rl.rollout.protocol import EngineUnavailable


def fake_server(token: str):
    """A server answering /health to anyone and any other GET only with `token` (rollout/auth.py's rule)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            allowed = self.path == "/health" or self.headers.get("Authorization") == f"Bearer {token}"
            body = b'{"data": []}' if allowed else b'{"error": "unauthorized"}'
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


@pytest.mark.parametrize("owner", ["another job", "this job"])
def test_fake_server_on_the_port_is_ready_only_when_it_takes_this_jobs_token(monkeypatch, tmp_path, waiting_process,
                                                                               owner):
    monkeypatch.setenv(TOKEN_ENV, "this-job")
    http = fake_server("other-job" if owner == "another job" else "this-job")
    try:
        url = f"http://127.0.0.1:{http.server_address[1]}"
        server = ServerProcess(waiting_process, url, tmp_path / "server.log", "vllm-0")
        if owner == "this job":
            server.wait_ready(timeout_s=10)
            return
        with pytest.raises(EngineUnavailable, match=r"another server already listens at http://127\.0\.0\.1:\d+ "
                                                    r"\(it refused this job's rollout token\)"):
            server.wait_ready(timeout_s=10)
    finally:
        http.shutdown()
        http.server_close()
