"""Which network interface this node reaches its peers through (for gloo's
``GLOO_SOCKET_IFNAME``), found without sending a packet.

Gloo picks the address its workers listen on by resolving the machine's hostname.  On many
machines (and in a network namespace) the hostname resolves to 127.0.0.1, so every worker
advertises loopback and a peer on another node connects to its own loopback: the job hangs in
"Connection refused" retries (issue 24).  The launcher knows an address on the other side --
the coordinator's -- so it asks the kernel which local address a datagram to it would leave
from (a UDP ``connect`` sends nothing) and names the interface holding that address.

Linux only (``SIOCGIFADDR``); elsewhere, or when no interface holds the address, the caller
leaves gloo's own choice alone and says so.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import time
from typing import Optional

__all__ = ["route_interface", "interface_of", "wait_reachable", "NoRoute"]

_SIOCGIFADDR = 0x8915


class NoRoute(OSError):
    """This machine has no route to the address."""


def route_interface(host: str, port: int) -> tuple[Optional[str], str]:
    """(interface name or None, local IPv4 address) of the route to ``host:port``."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise NoRoute(f"cannot resolve {host!r}: {exc}") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(infos[0][4])
        except OSError as exc:
            raise NoRoute(f"no route to {host}:{port}: {exc}") from None
        local = s.getsockname()[0]
    return interface_of(local), local


def interface_of(address: str) -> Optional[str]:
    """The interface that holds IPv4 ``address``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def wait_reachable(endpoints: list[tuple[str, int]], timeout_s: float, every_s: float = 0.2) -> Optional[str]:
    """Wait up to ``timeout_s`` for something to accept a TCP connection at one of ``endpoints``
    (``(host, port)``; closed at once, nothing is sent).  None once one does, else why not (the
    last error).

    The launcher asks this before its coordinator client connects (torch's ``TCPStore`` for a
    node other than 0, the etcd client on every node): that client runs once the warm-start
    template's imports are done (seconds) and the TCPStore prints a C++ stack trace per failed
    attempt, so an endpoint that nobody serves is reported at once, cleanly."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    why = "no attempt"
    while True:
        for host, port in endpoints:
            left = deadline - time.monotonic()
            try:
                with socket.create_connection((host, port), timeout=max(0.05, min(1.0, left))):
                    return None
            except OSError as exc:
                why = f"{host}:{port}: {exc.strerror or str(exc) or type(exc).__name__}"
        if deadline - time.monotonic() <= 0:
            return why
        time.sleep(min(every_s, max(0.0, deadline - time.monotonic())))
