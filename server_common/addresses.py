"""Addresses a peer can dial: what a server advertises when it binds a wildcard, and how configured worker
addresses (literal, DNS names, or files of them) expand to endpoints."""
from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) keeps traffic on this machine."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost: assume it is reachable from elsewhere
        return False


def advertise_host(bind_host: str, explicit: str | None = None) -> str:
    """The host a peer should dial to reach a server bound on `bind_host`.

    `explicit` wins. A specific bind address is its own answer. A wildcard bind (0.0.0.0, ::) advertises the
    source address of this host's default route (a container's or pod's own IP), else the address this host's
    name resolves to when that is not loopback, else the host name.
    """
    if explicit:
        return explicit
    if bind_host not in WILDCARDS:
        return bind_host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent; the kernel picks the outgoing address
            return s.getsockname()[0]
    except OSError:
        pass
    try:
        by_name = socket.gethostbyname(socket.gethostname())
        if not is_loopback(by_name):
            return by_name
    except OSError:
        pass
    return socket.gethostname()


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port).

    Raises:
        ValueError: no port, or a port that is not a number.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"malformed address {address!r}; expected host:port")
    return host.strip("[]"), int(port)


def expand(entry: str) -> list[str]:
    """The endpoints ("ip:port") a configured worker address stands for right now.

    - "@FILE": every non-empty, non-comment line of FILE, expanded in turn (re-read at every call).
    - "host:port": every address `host` resolves to (a compose service or a Kubernetes headless Service name
      resolves to all its replicas); a literal IP stands for itself. A name that does not resolve stands for
      nothing, for now.

    Raises:
        ValueError: a malformed address.
    """
    if entry.startswith("@"):
        path = Path(entry[1:])
        lines = path.read_text().splitlines() if path.is_file() else []
        entries = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        return [endpoint for e in entries for endpoint in expand(e)]
    host, port = split_host_port(entry)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    out = []
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        endpoint = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if endpoint not in out:
            out.append(endpoint)
    return out
