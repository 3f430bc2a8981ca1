"""Outbound policies for local workers: each such worker runs in a network namespace of its own, joined to the
machine by a veth pair on a /30 of 169.254.0.0/16, whose firewall (iptables, inside the namespace) accepts
connections to the allowed networks and loopback and rejects every other.

The one module that runs `ip` and `iptables`. A failure is "Outbound policy: <why>". The namespace outlives its
worker until the runtime removes it (`remove`), with its veth pair.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import subprocess
from collections.abc import Sequence

from activities.agent.runtime.base import RuntimeFailure
from workflows.domain.reasons import R

COMMAND_TIMEOUT_SECONDS = 20.0
LINK_RANGE = ipaddress.ip_network("169.254.0.0/16")


def missing() -> str | None:
    """Why this machine cannot enforce outbound policies, or None."""
    if os.geteuid() != 0:
        return "its agent is not root: network namespaces and firewall rules need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"axprobe{os.getpid()}"
    try:
        return _failed(["ip", "netns", "add", probe]) or _failed(
            ["ip", "netns", "exec", probe, "iptables", "-A", "OUTPUT", "-j", "REJECT"]
        )
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)


def namespace_of(slug: str) -> str:
    """The attempt's namespace name: short enough for its interfaces' names (15 characters at most)."""
    return "ax" + hashlib.sha256(slug.encode()).hexdigest()[:10]


def create(slug: str, allow: Sequence[str]) -> list[str]:
    """The attempt's namespace with its veth pair and firewall; returns the prefix that runs a command in it."""
    name = namespace_of(slug)
    remove(name)  # what a former try of this start left half made
    block = int(hashlib.sha256(slug.encode()).hexdigest()[:8], 16) % (LINK_RANGE.num_addresses // 4)
    base = LINK_RANGE.network_address + 4 * block
    host, worker = f"{base + 1}", f"{base + 2}"
    outside, inside = f"{name}h", f"{name}n"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", name],
        ["ip", "addr", "add", f"{host}/30", "dev", outside],
        ["ip", "link", "set", outside, "up"],
        ["ip", "-n", name, "addr", "add", f"{worker}/30", "dev", inside],
        ["ip", "-n", name, "link", "set", inside, "up"],
        ["ip", "-n", name, "link", "set", "lo", "up"],
        ["ip", "-n", name, "route", "add", "default", "via", host],
    ]
    firewall = [["-A", "OUTPUT", "-o", "lo", "-j", "ACCEPT"]]
    firewall += [["-A", "OUTPUT", "-d", network, "-j", "ACCEPT"] for network in allow if ":" not in network]
    firewall += [["-A", "OUTPUT", "-j", "REJECT"]]
    try:
        for step in steps:
            _run(step)
        for rule in firewall:
            _run(["ip", "netns", "exec", name, "iptables", *rule])
        # IPv6: nothing but loopback (the namespace has no IPv6 route; the rules say so should one appear).
        _run(["ip", "netns", "exec", name, "ip6tables", "-A", "OUTPUT", "!", "-o", "lo", "-j", "REJECT"])
    except RuntimeFailure:
        remove(name)
        raise
    return ["ip", "netns", "exec", name]


def remove(name: str) -> None:
    """Remove a namespace and its veth pair; one that is not there is no error."""
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False, timeout=COMMAND_TIMEOUT_SECONDS)
    subprocess.run(["ip", "link", "del", f"{name}h"], capture_output=True, check=False, timeout=COMMAND_TIMEOUT_SECONDS)


def _run(command: list[str]) -> None:
    why = _failed(command)
    if why is not None:
        raise RuntimeFailure(R.OutboundPolicyFailed(why=why))


def _failed(command: list[str]) -> str | None:
    """Why the command failed (the command and its error), or None once it succeeded."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=COMMAND_TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{' '.join(command)}: {err}"
    if done.returncode != 0:
        return f"{' '.join(command)}: {done.stderr.strip() or f'exit status {done.returncode}'}"
    return None
