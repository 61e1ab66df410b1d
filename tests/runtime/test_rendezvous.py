"""The job's TCP stores listen on the address they are reached at (runtime/rendezvous.py), never
on every interface unasked: the process group's store a rank hosts, torchrun's own store (started
through runtime/torchrun.py), the weight transport's group store. Seen in /proc/net/tcp{,6}: what a
socket is bound to, whatever the machine's network lets through."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import sys
import textwrap

import pytest

from _support.processes import REPO, child_env, free_port
from _support.sockets import listening_addresses
from megatron_rl.rollout.weights.group import host_store
from megatron_rl.runtime.rendezvous import BIND_ENV, bind_address

EVERY_INTERFACE = {"0.0.0.0", "::"}


def _process_group_listeners(port: int, send) -> None:
    """In a forked child: a one-rank process group as `megatron-rl train` starts it alone."""
    import torch

    from megatron_rl.runtime.distributed import LaunchEnv, init_process_group

    init_process_group(torch.device("cpu"), LaunchEnv(0, 1, 0, "127.0.0.1", port, "single"))
    send.send(listening_addresses(port=port))


def test_a_single_host_process_group_listens_on_loopback_only():
    port = free_port()
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_process_group_listeners, args=(port, send))
    child.start()
    assert receive.poll(120), "the process group did not start"
    found = receive.recv()
    child.join(30)
    assert found == {"127.0.0.1"}, f"the rendezvous store listens on {found}"


def _non_loopback_address() -> str | None:
    """This machine's address on its default route, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("host", ["127.0.0.1", "node address"])
def test_the_weight_group_store_listens_on_its_host_only(host):
    if host == "node address":
        host = _non_loopback_address()
        if host is None:
            pytest.skip("this machine has no address but loopback")
    store = host_store(host, free_port(), timeout_s=10)
    assert listening_addresses(port=store.port) == {host}
    del store


def test_every_interface_only_when_asked(monkeypatch):
    assert bind_address("127.0.0.1") == "127.0.0.1" and bind_address("localhost") == "127.0.0.1"
    monkeypatch.setenv(BIND_ENV, "0.0.0.0")
    assert bind_address("127.0.0.1") == "0.0.0.0"


WORKER = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
    from _support.sockets import listening_addresses
    print("LISTENERS", json.dumps(sorted(listening_addresses(os.getppid(), int(os.environ["MASTER_PORT"])))))
""")


@pytest.mark.subprocess
def test_torchruns_own_store_listens_on_its_master_address_only(tmp_path):
    """What `launch local` and the conversions start: the ranks' parent is torchrun, whose
    rendezvous store they join."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    command = [sys.executable, "-m", "megatron_rl.runtime.torchrun", "--nproc-per-node=1", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", str(worker), str(REPO)]
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("LISTENERS")]
    assert line == 'LISTENERS ["127.0.0.1"]', line
