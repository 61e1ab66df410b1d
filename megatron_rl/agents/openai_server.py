"""A loopback HTTP server that speaks OpenAI's chat-completions protocol for the rollout.

    server = ChatCompletionsServer(handle)             # handle(token, body) -> response dict
    server.base_url(token)                             # "http://127.0.0.1:PORT/t/<token>/v1"
    server.close()

Only what an agent written against the OpenAI client needs: `POST .../v1/chat/completions`
(non-streaming) and `GET .../v1/models`. The path carries the trajectory's token, so an agent
needs nothing but its base URL (any API key is accepted) and cannot write into another
trajectory's record: `handle` refuses a token no running trajectory holds (404), and the tokens
are random (agents/openai_agent.py), so no URL can be derived from another. It listens on
127.0.0.1 only: the agents run in this process's threads or on this machine. Each request is
served in its own thread and blocks there until the rollout answers (an engine request may batch
many agents' calls), so a slow call holds only its agent.

`handle` raises `EndpointError(status, message)` for a request it refuses (bad JSON, n > 1,
streaming, a trajectory that has ended); the agent sees OpenAI's error shape
`{"error": {"message", "type", "code"}}` with that status, as from the real API. The server itself
answers 400 to a body that is not a JSON object or nests deeper than MAX_NESTING levels, and to a
request holding such a value as text (tool-call arguments: a RecursionError while handling it).
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from megatron_rl.errors import nested_deeper

_ROUTE = re.compile(r"^/t/(?P<token>[A-Za-z0-9_-]{1,128})/v1/(?P<what>chat/completions|models)/?$")
MAX_BODY = 64 * 1024 * 1024  # a request body larger than this is refused (a runaway history)
# Levels of nested arrays and objects a request may have (400 beyond): a chat request has about 5,
# a tool's JSON schema a few more; Python's JSON parser and the code after it recurse per level
# and give out near 1,000 (a RecursionError, which was a 500).
MAX_NESTING = 100


class EndpointError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


Handle = Callable[[str, dict], dict]


class ChatCompletionsServer:
    def __init__(self, handle: Handle, model_name: str = "policy"):
        self.handle, self.model_name = handle, model_name
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802 - the http.server API
                route = _ROUTE.match(self.path)
                if route is None or route["what"] != "models":
                    return self._send(404, _error(f"no route GET {self.path}", "not_found"))
                self._send(200, {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                                              "owned_by": "megatron_rl"}]})

            def do_POST(self):  # noqa: N802
                route = _ROUTE.match(self.path)
                if route is None or route["what"] != "chat/completions":
                    return self._send(404, _error(f"no route POST {self.path}", "not_found"))
                try:
                    body = self._body()
                    self._send(200, server.handle(route["token"], body))
                except EndpointError as exc:
                    self._send(exc.status, _error(exc.message, "invalid_request_error"))
                except RecursionError:  # a value inside the request (tool-call arguments as JSON text) nested too deep
                    self._send(400, _error(f"the request holds a value nested more than {MAX_NESTING} levels deep",
                                           "invalid_request_error"))
                except Exception as exc:  # noqa: BLE001 - an internal failure is the agent's 500, never a hang
                    self._send(500, _error(f"{type(exc).__name__}: {exc}"[:500], "server_error"))

            def _body(self) -> dict:
                length = self.headers.get("Content-Length") or "0"
                if not length.isdigit():  # read(-1) would wait for the client to close the connection
                    raise EndpointError(400, f"Content-Length must be a number of bytes, got {length!r}")
                if int(length) > MAX_BODY:
                    raise EndpointError(413, f"request body of {length} bytes is larger than {MAX_BODY}")
                raw = self.rfile.read(int(length)) or b"null"
                nested = EndpointError(400, f"the request body is nested more than {MAX_NESTING} levels deep")
                try:
                    body = json.loads(raw)
                except RecursionError:
                    raise nested from None
                except ValueError as exc:
                    raise EndpointError(400, f"the request body is not JSON: {exc}") from None
                if not isinstance(body, dict):
                    raise EndpointError(400, "the request body must be a JSON object")
                # Counting brackets first keeps the walk off every ordinary request.
                if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and nested_deeper(body, MAX_NESTING):
                    raise nested
                return body

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format, *args):  # noqa: A002 - silence per-request stderr lines
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="chat-completions", daemon=True)
        self._thread.start()

    def base_url(self, token: str) -> str:
        return f"http://127.0.0.1:{self.port}/t/{token}/v1"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _error(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "code": None}}
