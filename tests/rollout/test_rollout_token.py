"""The job's rollout token (megatron_rl/rollout/auth.py): servers started from several threads at
once all get the one token this process then sends (each thread making its own left the first
server refusing every request: HTTP 401 in the engine-failover tests)."""

import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

from megatron_rl.rollout import auth


def test_threads_that_start_servers_at_once_share_one_token(monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)

    def slow_token(nbytes):  # widens the window between "unset?" and "set" to where threads meet
        time.sleep(0.05)
        return secrets.token_hex(nbytes)

    monkeypatch.setattr(auth.secrets, "token_urlsafe", slow_token)
    with ThreadPoolExecutor(max_workers=4) as pool:
        tokens = list(pool.map(lambda _: auth.ensure_rollout_token(), range(4)))
    assert len(set(tokens)) == 1 and os.environ[auth.TOKEN_ENV] == tokens[0], tokens
