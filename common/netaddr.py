"""Which address this process should advertise so that services on other hosts can dial it.

An executor bound to all interfaces (0.0.0.0) must still name one address in Redis. Its host
name works on one Docker network, but not across nodes or clusters, where names do not resolve
everywhere; an IP does. In order of preference: ``POD_IP`` (Kubernetes' downward API sets it,
see deploy/kubernetes/executor.yaml), the first non-loopback IP the host name resolves to (a
container's or VM's own address, from /etc/hosts or DNS), and the host name itself.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping


def _usable(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_unspecified or ip.is_link_local)


def reachable_host(environ: Mapping[str, str] | None = None) -> str:
    """This host's address for other hosts to dial (see the module docstring for the order)."""
    env = os.environ if environ is None else environ
    pod_ip = env.get("POD_IP", "").strip()
    if pod_ip:
        return pod_ip
    hostname = socket.gethostname()
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except OSError:
        return hostname
    for family in (socket.AF_INET, socket.AF_INET6):  # IPv4 first: what most networks route
        for info_family, _, _, _, sockaddr in infos:
            if info_family == family and _usable(str(sockaddr[0])):
                return str(sockaddr[0])
    return hostname


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets as gRPC targets want it."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"
