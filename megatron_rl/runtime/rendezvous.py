"""The TCP stores of a job (the process group's rendezvous, the weight transport's group) listen on
the address they are reached at, never on every interface unless asked.

torch's TCPStore server ignores the host it is given and listens on every interface (`::`), so a
single-host run's store accepted connections from the machine's public address: anyone who could
reach the port could write into the rendezvous of the job. Here a store's server listens on a
socket bound to the address its clients are told to use:

* a single-host run is reached at 127.0.0.1 (the single-process default, `launch local`, the
  conversions' ranks): loopback only;
* a multi-node job is reached at MASTER_ADDR, the first node's address as the SLURM job script
  gives it: that address only;
* MEGATRON_RL_BIND_ADDR overrides the listening address (0.0.0.0: every interface, when that is
  really meant, e.g. MASTER_ADDR is a name this host does not resolve to its own address).

`bound_stores()` makes torchrun's own stores (its rendezvous, which the ranks use under torchrun)
follow the same rule: see megatron_rl/runtime/torchrun.py.
"""

from __future__ import annotations

import datetime
import os
import socket
from contextlib import contextmanager

from megatron_rl.errors import ConfigError

BIND_ENV = "MEGATRON_RL_BIND_ADDR"
# The keyword names of torch.distributed.TCPStore's constructor, in order (it takes them positionally too).
_STORE_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
               "master_listen_fd", "use_libuv")


def bind_address(host: str) -> str:
    """The address a store reached at `host` listens on: MEGATRON_RL_BIND_ADDR if set, else
    `host` resolved (IPv4 first): 127.0.0.1 stays loopback, a node's name becomes its address."""
    chosen = os.environ.get(BIND_ENV)
    if chosen:
        return chosen
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"rendezvous host {host!r} does not resolve ({exc}); set MASTER_ADDR to this node's "
                          f"address, or {BIND_ENV} to the address to listen on") from None
    found.sort(key=lambda entry: entry[0] != socket.AF_INET)
    return found[0][4][0]


def listening_socket(address: str, port: int) -> tuple[int, int]:
    """A TCP socket listening on `address`:`port` (0: a free port), as (file descriptor, port); the
    caller's store takes the descriptor over."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {address}:{port} for the rendezvous ({exc.strerror}); if {address} "
                          f"is not an address of this host, set MASTER_ADDR to one, or {BIND_ENV} to the address to "
                          "listen on") from None
    bound = sock.getsockname()[1]
    return sock.detach(), bound


def store_server(host: str, port: int, *, world_size: int | None = None, timeout_s: float = 300,
                 wait_for_workers: bool = False, multi_tenant: bool = False):
    """The server side of a TCPStore reached at `host`:`port`, listening on bind_address(host)."""
    import torch.distributed as dist

    descriptor, port = listening_socket(bind_address(host), port)
    return dist.TCPStore(host, port, world_size, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                         master_listen_fd=descriptor, use_libuv=True)


@contextmanager
def bound_stores():
    """Inside the block, every TCPStore server torch creates in this process listens on
    bind_address(its host) (torchrun's rendezvous, which has no option for it)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    original = dist.TCPStore

    class BoundTCPStore(original):
        def __init__(self, *args, **kwargs):
            given = dict(zip(_STORE_ARGS, args), **kwargs)
            if given.get("is_master") and given.get("master_listen_fd") is None:
                given["master_listen_fd"], given["port"] = listening_socket(bind_address(given["host_name"]),
                                                                            given["port"])
                given["use_libuv"] = True  # the server that can take a listening socket
            super().__init__(**given)

    modules = (dist, static_tcp_rendezvous, c10d_rendezvous_backend)
    for module in modules:
        module.TCPStore = BoundTCPStore
    try:
        yield
    finally:
        for module in modules:
            module.TCPStore = original
