"""A small JSON-over-HTTP client with timeouts and bounded retries, shared by the server engines.

Standard library only: the trainer should not need an async HTTP stack to talk to a few servers,
and each request runs on its own thread (see the engines)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from megatron_rl.rollout.auth import TOKEN_ENV, authorization_header, rollout_token
from megatron_rl.rollout.protocol import EngineError, EngineTimeout, EngineUnauthorized, EngineUnavailable

# Statuses worth a retry: the server is up but momentarily cannot answer.
_TRANSIENT = {429, 502, 503, 504}


class JsonClient:
    def __init__(self, name: str, base_url: str, *, timeout_s: float, max_retries: int, backoff_s: float = 1.0,
                 token: str | None = None):
        """`token`: the job's rollout token (rollout/auth.py); None: MEGATRON_RL_ROLLOUT_TOKEN's value."""
        self.name, self.base_url = name, base_url.rstrip("/")
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self._headers = {"Content-Type": "application/json", **authorization_header(token or rollout_token())}

    def post(self, path: str, body: dict | None = None, *, timeout_s: float | None = None, params: str = "",
             retries: int | None = None) -> Any:
        """`retries=0` for calls that must not run twice (a collective the other side joins once)."""
        data = json.dumps(body if body is not None else {}).encode()
        return self._request("POST", path + (f"?{params}" if params else ""), data, timeout_s, retries)

    def get(self, path: str, *, timeout_s: float | None = None, retries: int | None = None) -> Any:
        return self._request("GET", path, None, timeout_s, retries)

    def _request(self, method: str, path: str, data: bytes | None, timeout_s: float | None, retries: int | None = None):
        timeout = self.timeout_s if timeout_s is None else timeout_s
        attempts = 1 + (self.max_retries if retries is None else retries)
        url = f"{self.base_url}{path}"
        last: Exception | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=data, method=method, headers=self._headers)
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    payload = response.read()
                try:
                    return json.loads(payload) if payload else None
                except RecursionError:  # nested deeper than Python recurses: "not JSON" to callers, as a ValueError
                    raise ValueError(f"{self.name}: {method} {path} answered JSON nested too deeply to read") from None
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:500]
                if exc.code in (401, 403):
                    raise EngineUnauthorized(f"{self.name}: {method} {path} -> HTTP {exc.code}: the server refused this "
                                             f"client's rollout token; trainer and servers must share the job's "
                                             f"{TOKEN_ENV}") from exc
                if exc.code not in _TRANSIENT:
                    raise EngineError(f"{self.name}: {method} {path} -> HTTP {exc.code}: {detail}") from exc
                last = EngineError(f"{self.name}: {method} {path} -> HTTP {exc.code}: {detail}")
            except TimeoutError:
                last = EngineTimeout(f"{self.name}: {method} {path} timed out after {timeout:.0f}s")
            except urllib.error.URLError as exc:
                if isinstance(exc.reason, TimeoutError):
                    last = EngineTimeout(f"{self.name}: {method} {path} timed out after {timeout:.0f}s")
                else:
                    last = EngineUnavailable(f"{self.name}: cannot reach {url}: {exc.reason}")
            except (ConnectionError, OSError) as exc:
                last = EngineUnavailable(f"{self.name}: connection to {url} failed: {exc}")
        assert last is not None
        raise type(last)(f"{last} (after {attempts} attempt{'s' if attempts > 1 else ''})")
