"""Rollout servers answer only to their job: one secret per job, on every request but /health.

vLLM's dev mode (which our servers need for /collective_rpc) exposes weight loading, process-group
joins and pause to anyone who can reach the port, and vLLM's own --api-key guards only the /v1
routes. So every server we start runs `RolloutTokenMiddleware` (vLLM's --middleware), which
refuses any request without `Authorization: Bearer <token>` with 401, whatever the route; /health
stays open for liveness probes (it reveals nothing and changes nothing).

The token comes from MEGATRON_RL_ROLLOUT_TOKEN: the SLURM job script makes one per job (rollout
nodes and trainer inherit it through srun); a trainer that starts its own servers makes one if
the variable is unset. It travels in the environment only: never on a command line (visible to
every user in `ps`), in a config file or a log.
"""

from __future__ import annotations

import hmac
import os
import secrets
import threading

TOKEN_ENV = "MEGATRON_RL_ROLLOUT_TOKEN"
OPEN_PATHS = frozenset({"/health"})
MIDDLEWARE = "megatron_rl.rollout.auth.RolloutTokenMiddleware"


def rollout_token() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


# Servers started from several threads at once (the engine pool's) must all get one token: without
# the lock two threads could each make one, and the first server would refuse this process's token.
_TOKEN_LOCK = threading.Lock()


def ensure_rollout_token() -> str:
    """This job's token, made now (and exported to the servers this process starts) if unset."""
    with _TOKEN_LOCK:
        token = rollout_token()
        if token is None:
            token = os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)
        return token


def authorization_header(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class RolloutTokenMiddleware:
    """ASGI middleware (loaded by vLLM's --middleware): 401 for any request without this job's
    token, except OPEN_PATHS. Refuses to start without a token: an open server is the failure
    this exists to prevent."""

    def __init__(self, app):
        token = rollout_token()
        if token is None:
            raise RuntimeError(f"{TOKEN_ENV} is not set: a rollout server must not start without its job's token")
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body",
                    "body": f'{{"error": "unauthorized: this rollout server needs its job\'s {TOKEN_ENV}"}}'.encode()})
