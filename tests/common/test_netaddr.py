"""The address an executor advertises when bound to all interfaces."""

from __future__ import annotations

import ipaddress
import socket

from common.netaddr import host_port, reachable_host
from common.service import advertise_address


def test_pod_ip_wins() -> None:
    assert advertise_address("0.0.0.0", 50061, "", {"POD_IP": "10.4.0.17"}) == "10.4.0.17:50061"
    assert advertise_address("::", 50061, "", {"POD_IP": "fd00::17"}) == "[fd00::17]:50061"


def test_configured_address_and_a_specific_bind_are_kept() -> None:
    assert advertise_address("0.0.0.0", 50061, "exec.example:7000", {"POD_IP": "10.4.0.17"}) == "exec.example:7000"
    assert advertise_address("127.0.0.1", 50061, "", {"POD_IP": "10.4.0.17"}) == "127.0.0.1:50061"


def test_without_pod_ip_a_routable_ip_or_the_host_name() -> None:
    host = reachable_host({})
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        assert host == socket.gethostname()  # nothing but loopback resolves here
    else:
        assert not ip.is_loopback and not ip.is_unspecified


def test_host_port_brackets_ipv6() -> None:
    assert host_port("10.0.0.1", 1) == "10.0.0.1:1"
    assert host_port("2001:db8::1", 2) == "[2001:db8::1]:2"
    assert host_port("[2001:db8::1]", 2) == "[2001:db8::1]:2"
