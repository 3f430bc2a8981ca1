"""A real Docker engine for tests: Debian's `dockerd` with its own data root, exec root, pidfile and socket under a
temporary directory, and a local image made with `docker import` from a busybox-static rootfs (no registry is
reachable). `make test` installs `docker.io` and `busybox-static` when they are missing."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import time
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
IMAGE = "local/busybox:latest"
READY_SECONDS = 30.0
RUNSC = "/usr/bin/runsc"
# Registered with the engine: gVisor (Debian's runsc, without a network inside the sandbox: the test engine has no
# bridge), and a sandbox runtime that refuses every container, as a broken install would.
RUNTIMES = {
    "runsc": {"path": RUNSC, "runtimeArgs": ["--network=none"]},
    "broken-sandbox": {"path": "/bin/false"},
}


def sandbox_missing() -> str | None:
    """Why the engine cannot run sandboxed workers here, or None."""
    if not Path(RUNSC).exists():
        return f"{RUNSC} is not installed (make test installs Debian's runsc)"
    return None


def missing() -> str | None:
    """Why no engine can be started here, or None."""
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        return "dockerd is not installed (make test installs Debian's docker.io)"
    if not BUSYBOX.exists():
        return "/bin/busybox is not installed (make test installs Debian's busybox-static)"
    if os.geteuid() != 0:
        return "dockerd needs root"
    return None


class DockerEngine:
    """`start()` runs dockerd under `root` and imports the busybox image; `stop()` ends it by its PID. With `netns`
    it runs in that network namespace (another machine's network; entered with nsenter, which leaves the mounts of
    /sys, and so the cgroups, as they are), keeping a firewall there as Docker does on a machine of its own (its
    bridges' FORWARD and NAT rules)."""

    def __init__(self, root: Path, netns: str | None = None) -> None:
        self.root = root
        self.socket = root / "docker.sock"
        self.host = f"unix://{self.socket}"
        self.process: subprocess.Popen[bytes] | None = None
        self.netns = netns

    def start(self) -> None:
        exec_root = self.root / "exec"
        exec_root.mkdir(parents=True, exist_ok=True)
        config = self.root / "daemon.json"
        config.write_text(json.dumps({"runtimes": RUNTIMES if sandbox_missing() is None else {}}))
        firewall = ["--ip6tables=false"] if self.netns else ["--iptables=false", "--ip6tables=false", "--ip-masq=false"]
        command = [
            *(["nsenter", f"--net=/var/run/netns/{self.netns}"] if self.netns else []),
            "dockerd",
            "--host", self.host,
            "--data-root", str(self.root / "data"),
            "--exec-root", str(exec_root),
            "--pidfile", str(exec_root / "dockerd.pid"),
            "--storage-driver", "overlay2",
            *firewall, "--bridge=none",
            "--shutdown-timeout", "2",
            "--config-file", str(config),
        ]  # fmt: skip
        with (self.root / "dockerd.log").open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_until_ready()
        self.import_image(IMAGE)

    def import_image(self, name: str) -> None:
        """`docker import` a rootfs of busybox-static: its applets linked, a passwd and a group file."""
        rootfs = self.root / "rootfs.tar"
        if not rootfs.exists():
            _busybox_rootfs(rootfs)
        self.docker("import", "--change", 'CMD ["/bin/sh"]', str(rootfs), name)

    def docker(self, *args: str) -> str:
        done = subprocess.run(
            ["docker", "--host", self.host, *args], capture_output=True, text=True, timeout=60, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def stop(self) -> None:
        """SIGTERM dockerd (it stops its containers and containerd), SIGKILL it if it lingers; then unmount, and
        delete the bridges of its networks, which a stopped engine leaves on the machine (stale routes to their
        subnets otherwise outlive it: the next engine's network of the same subnet would not be reached)."""
        process, self.process = self.process, None
        bridges = self._bridges() if process is not None and process.poll() is None else []
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                _kill_pidfile(self.root / "exec" / "containerd" / "containerd.pid")
        for mount in _mounts_under(self.root):
            subprocess.run(["umount", "--lazy", mount], check=False, capture_output=True)
        for bridge in bridges:
            subprocess.run(["ip", "link", "del", bridge], check=False, capture_output=True)

    def _bridges(self) -> list[str]:
        """The bridges of its own networks, in this machine's namespace (an engine in a namespace of its own takes
        them with it)."""
        if self.netns is not None:
            return []
        try:
            ids = self.docker("network", "ls", "--quiet", "--no-trunc", "--filter", "driver=bridge").split()
        except (RuntimeError, subprocess.TimeoutExpired):
            return []
        return [f"br-{network[:12]}" for network in ids]

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + READY_SECONDS
        while not _ping(self.socket):
            assert self.process is not None
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.root / "dockerd.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"dockerd did not become ready:\n{log}")
            time.sleep(0.05)


def _ping(path: Path) -> bool:
    """GET /_ping on the engine's socket answers OK once it serves."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(2)
            conn.connect(str(path))
            conn.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b" 200 " in conn.recv(1024).split(b"\r\n", 1)[0]
    except OSError:
        return False


def _busybox_rootfs(tar_path: Path) -> None:
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
    staging = tar_path.with_suffix(".d")
    (staging / "bin").mkdir(parents=True, exist_ok=True)
    (staging / "etc").mkdir(exist_ok=True)
    (staging / "tmp").mkdir(exist_ok=True)
    shutil.copy2(BUSYBOX, staging / "bin" / "busybox")
    for applet in applets:
        link = staging / "bin" / applet
        if applet != "busybox" and not link.exists():
            link.symlink_to("busybox")
    (staging / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
    (staging / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    with tarfile.open(tar_path, "w") as tar:
        tar.add(staging, arcname=".")


def _kill_pidfile(path: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(path.read_text()), signal.SIGKILL)


def _mounts_under(root: Path) -> list[str]:
    """Mount points under `root` (the engine's netns and overlays, if it left any), deepest first."""
    prefix = str(root.resolve()) + "/"
    points = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)
