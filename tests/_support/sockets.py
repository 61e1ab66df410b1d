"""Which addresses a process listens on, read from /proc (Linux): how the tests see that a store
is bound to loopback rather than to every interface.

    from _support.sockets import listening_addresses

    listening_addresses(pid, port)  # {"127.0.0.1"} or {"::"} (every interface), ...
"""

from __future__ import annotations

import ipaddress
import os
import socket

__all__ = ["listening_addresses"]

LISTEN = "0A"


def listening_addresses(pid: int | str = "self", port: int | None = None) -> set[str]:
    """The local addresses of `pid`'s listening TCP sockets (on `port` only, if given)."""
    inodes = _socket_inodes(pid)
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as handle:
            for line in handle.read().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].split(":")
                if fields[3] == LISTEN and fields[9] in inodes and (port is None or int(hex_port, 16) == port):
                    found.add(_address(address, family))
    return found


def _socket_inodes(pid) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_address: str, family: int) -> str:
    """/proc/net/tcp's address: 32-bit words in host byte order (little-endian here)."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))
