"""Two test hosts on this machine: network namespaces joined by a veth pair, each with its own address."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class TestHost:
    netns: str
    addr: str
    ifname: str

    def run(self, argv: list[str]) -> list[str]:
        """`argv` as run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    if shutil.which("ip") is None:
        return "needs ip(8) from iproute2"
    probe = f"cona-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextmanager
def two_hosts(subnet: str = "10.213.77") -> Iterator[tuple[TestHost, TestHost]]:
    """Namespaces a and b with veth ends at {subnet}.1 and {subnet}.2 (/24), loopback up in each."""
    tag = f"cona{os.getpid() % 100000}"
    hosts = (TestHost(f"{tag}a", f"{subnet}.1", f"{tag}va"), TestHost(f"{tag}b", f"{subnet}.2", f"{tag}vb"))
    try:
        for h in hosts:
            _ip("netns", "add", h.netns)
        _ip("link", "add", hosts[0].ifname, "type", "veth", "peer", "name", hosts[1].ifname)
        for h in hosts:
            _ip("link", "set", h.ifname, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.netns, "link", "set", h.ifname, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for h in hosts:
            subprocess.run(["ip", "netns", "del", h.netns], capture_output=True)
