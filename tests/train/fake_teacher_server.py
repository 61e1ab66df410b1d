"""A stand-in for a teacher's vLLM server: OpenAI completions with `prompt_logprobs`, for tests of
how the trainer talks to a served teacher and what it does when the teacher fails.

    FakeTeacher(mode="ok")                  # in a thread of the test; .url, .requests, .sequences, .stop()
    python fake_teacher_server.py PORT      # as a process of its own (to be killed)

Its logprob of the token at position p of a sequence is logprob(token, p) below, so a test knows
every value it should get back. Choices are answered in reverse order (a client must match them
by their index). Modes: "ok"; "http500" (every completion request answers 500); "garbage" (200
with a body that is not JSON); "no_choices" (200 with JSON that is not a completion).
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def logprob(token: int, position: int) -> float:
    return -((token * 31 + position) % 97 + 1) / 64


class FakeTeacher:
    def __init__(self, mode: str = "ok", port: int = 0):
        self.mode, self.requests, self.sequences = mode, 0, 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200, b"{}")
                if self.path == "/v1/models":
                    return self._send(200, json.dumps({"data": [{"id": "teacher", "max_model_len": 1025}]}).encode())
                self._send(404, b'{"error": "no route"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    return self._send(404, b'{"error": "no route"}')
                fake.requests += 1
                if fake.mode == "http500":
                    return self._send(500, b'{"error": "EngineCore encountered an issue"}')
                if fake.mode == "garbage":
                    return self._send(200, b"<html>502 upstream gone</html>")
                if fake.mode == "no_choices":
                    return self._send(200, b'{"object": "error", "message": "overloaded"}')
                prompts = body["prompt"]
                prompts = prompts if prompts and isinstance(prompts[0], list) else [prompts]
                fake.sequences += len(prompts)
                choices = [{"index": index, "text": "", "finish_reason": "length",
                            "prompt_logprobs": [None] + [{str(token): {"logprob": logprob(token, position), "rank": 1}}
                                                         for position, token in enumerate(tokens) if position]}
                           for index, tokens in enumerate(prompts)]
                self._send(200, json.dumps({"choices": choices[::-1]}).encode())

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    def start(self) -> FakeTeacher:
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


if __name__ == "__main__":
    FakeTeacher(port=int(sys.argv[1])).serve_forever()
