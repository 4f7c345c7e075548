"""A free TCP port on the loopback interface, for servers and process groups started on this machine.

Example:
    >>> from flowopt.ports import free_port
    >>> 0 < free_port() < 65536
    True
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now on 127.0.0.1 (released again just before its user binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
