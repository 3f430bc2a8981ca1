"""This machine's end of the mesh: a WireGuard interface, its peers and routes, and the firewall rules that let the
mesh's traffic through the engine's. The one module that runs `ip`, `wg`, `wireguard-go` and the mesh's `iptables`,
each in the network namespace of the machine's engine (`--mesh-netns`; by default the agent's own).

The interface is the kernel's (`ip link add ... type wireguard`) where the kernel has WireGuard, else a
`wireguard-go` process (userspace, through /dev/net/tun) that the agent starts, records in its state directory and
ends by its PID when it stops; an agent that starts again ends one left by an earlier agent and makes the interface
anew. The private key is read from a file of the agent's (mode 0600) by `wg` itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from workflows.domain.mesh import FirewallRule, MeshPlan, PeerSeen

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_SECONDS = 10.0
USERSPACE_READY_SECONDS = 5.0
USERSPACE_STOP_SECONDS = 3.0
KEEPALIVE_SECONDS = 25  # a peer behind NAT keeps its mapping open; WireGuard's own advice
SOCKETS = Path("/var/run/wireguard")  # wireguard-go's control sockets, one per interface, for every namespace
FORWARDING = "/proc/sys/net/ipv4/ip_forward"


class MeshDown(Exception):
    """The interface, a peer, a route or a rule could not be set; the message says why."""


def missing(netns: str | None) -> str | None:
    """Why this machine cannot make a WireGuard interface, or None (the kernel's is tried when it is made)."""
    for tool, package in (("ip", "iproute2"), ("wg", "wireguard-tools"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian's {package})"
    if netns is not None and not Path("/var/run/netns", netns).exists():
        return f"there is no network namespace {netns} (`ip netns list`)"
    if shutil.which("wireguard-go") is not None:
        return None if Path("/dev/net/tun").exists() else "wireguard-go needs /dev/net/tun, which is missing"
    if Path("/sys/module/wireguard").exists():
        return None
    return "neither the kernel's WireGuard module nor wireguard-go (Debian's wireguard-go) is here"


class Link:
    """The machine's WireGuard interface `interface` in namespace `netns` (None: the agent's own)."""

    def __init__(self, interface: str, netns: str | None, state_dir: Path) -> None:
        self.interface = interface
        self.netns = netns
        self._pidfile = state_dir / "wireguard-go.pid"
        self._log = state_dir / "wireguard-go.log"
        self.userspace = False

    def up(self, private_key: Path, port: int) -> None:
        """Make the interface anew (one left by an earlier agent goes first), with the machine's key and port, up;
        and let the namespace forward (the mesh's traffic crosses from the interface to the node network's bridge)."""
        self.down()
        self.userspace = not self._try("ip", "link", "add", self.interface, "type", "wireguard")
        if self.userspace:
            self._start_userspace()
        self._run("wg", "set", self.interface, "private-key", str(private_key), "listen-port", str(port))
        self._run("ip", "link", "set", self.interface, "up")
        if self._run("cat", FORWARDING).strip() != "1":
            log.warning("%s: turning on IPv4 forwarding (%s)", self.interface, self.netns or "the agent's namespace")
            self._run("sh", "-c", f"echo 1 > {FORWARDING}")

    def down(self) -> None:
        """End the interface: its wireguard-go process (by the PID recorded), and the interface itself with its
        routes. Nothing to do when there is none."""
        pid = _recorded(self._pidfile)
        if pid is not None and _is_wireguard_go(pid, self.interface):
            _end(pid)
        self._pidfile.unlink(missing_ok=True)
        self._try("ip", "link", "del", self.interface)

    def peers(self) -> dict[str, PeerSeen]:
        """The peers the interface holds now, by public key (`wg show <interface> dump`)."""
        lines = self._run("wg", "show", self.interface, "dump").splitlines()[1:]  # the first: the interface itself
        held: dict[str, PeerSeen] = {}
        for line in lines:
            key, _psk, endpoint, allowed, *_ = line.split("\t")
            ips = tuple(sorted(a for a in allowed.split(",") if a and a != "(none)"))
            held[key] = PeerSeen(endpoint=None if endpoint == "(none)" else endpoint, allowed=ips)
        return held

    def routes(self) -> list[str]:
        """The IPv4 routes through the interface (`ip route show dev`)."""
        return [line.split()[0] for line in self._run("ip", "-4", "route", "show", "dev", self.interface).splitlines()]

    def apply(self, plan: MeshPlan) -> None:
        for key in plan.remove_peers:
            self._run("wg", "set", self.interface, "peer", key, "remove")
        for peer in plan.set_peers:
            keepalive = str(KEEPALIVE_SECONDS)
            self._run(
                "wg", "set", self.interface, "peer", peer.public_key, "endpoint", peer.endpoint,
                "allowed-ips", peer.subnet, "persistent-keepalive", keepalive,
            )  # fmt: skip
        for route in plan.remove_routes:
            self._try("ip", "route", "del", route, "dev", self.interface)
        for route in plan.add_routes:
            self._run("ip", "route", "replace", route, "dev", self.interface)

    def add_rules(self, rules: list[FirewallRule]) -> None:
        """Each rule first in its chain, unless it is there already."""
        for rule in rules:
            if not self._try("iptables", "-t", rule.table, "-C", rule.chain, *rule.spec):
                self._run("iptables", "-t", rule.table, "-I", rule.chain, "1", *rule.spec)

    def remove_rules(self, rules: list[FirewallRule]) -> None:
        """Each rule, as often as it is there; none there is no failure."""
        for rule in rules:
            for _ in range(10):
                if not self._try("iptables", "-t", rule.table, "-D", rule.chain, *rule.spec):
                    break

    def _start_userspace(self) -> None:
        """wireguard-go in the foreground, in a session of its own (it outlives no agent: the agent ends it)."""
        self._pidfile.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "WG_PROCESS_FOREGROUND": "1", "LOG_LEVEL": "error"}
        with self._log.open("ab") as out:
            process = subprocess.Popen(
                [*self._prefix(), "wireguard-go", self.interface],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self._pidfile.write_text(f"{process.pid}\n")
        deadline = time.monotonic() + USERSPACE_READY_SECONDS
        while not (SOCKETS / f"{self.interface}.sock").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                _end(process.pid)
                said = self._log.read_text(errors="replace")[-500:].strip()
                raise MeshDown(f"wireguard-go did not make {self.interface}: {said or 'it said nothing'}")
            time.sleep(0.02)

    def _prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if self.netns is not None else []

    def _run(self, *command: str) -> str:
        """Run a command in the namespace; its output. Raises MeshDown, saying what it said."""
        try:
            done = subprocess.run(
                [*self._prefix(), *command],
                capture_output=True,
                text=True,
                check=False,
                timeout=COMMAND_TIMEOUT_SECONDS,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise MeshDown(f"{' '.join(command)}: {err}") from err
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()
            raise MeshDown(f"{' '.join(command)}: {said or f'exit {done.returncode}'}")
        return done.stdout

    def _try(self, *command: str) -> bool:
        """Run a command in the namespace; whether it succeeded."""
        try:
            self._run(*command)
        except MeshDown:
            return False
        return True


def _recorded(pidfile: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(pidfile.read_text().strip())
    return None


def _is_wireguard_go(pid: int, interface: str) -> bool:
    """Whether `pid` is a wireguard-go of `interface` (a PID recorded by an earlier agent may since be another's)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(arg.endswith(b"wireguard-go") for arg in argv) and interface.encode() in argv


def _end(pid: int) -> None:
    """SIGTERM, then SIGKILL if it lingers; reaped when it is this process's child."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + USERSPACE_STOP_SECONDS
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
