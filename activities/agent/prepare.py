"""Preparing a worker on its machine: drives, secrets, registry credentials and the files it is given.

Each call of `Preparer.prepare` either finds everything ready (`Prepared`: what to add to the launch), finds a step
still waiting (`Waiting`, with the spec's reason, e.g. "waiting for external secret hf (key token) to be synced to
this node"), or fails for good (RuntimeFailure: "Invalid task: ...", "Writing config <path>: ..."). The agent calls
it again until it is ready, so a step that waits is a real wait.

Secrets live on the machine, never in a run's history: one file per key, `<data dir>/secrets/<name>/<key>`, put
there by whatever syncs secrets to machines. A registry secret has the keys `username` and `password`. A secret
given as a file is copied to `<data dir>/config/<attempt>/` and mounted read-only where the worker asked.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from activities.agent.drives import DriveStore
from activities.agent.runtime.base import Mount, RegistryAuth, RuntimeFailure, forget_attempts
from workflows.domain.constraints import Drive
from workflows.domain.drives import source_path
from workflows.domain.group_parts import DriveSpec, SecretSpec
from workflows.domain.reasons import R, Reason
from workflows.domain.refs import TaskRef
from workflows.domain.spec import GroupSpec

# Host paths no worker may mount, whatever the machine allows: the system's own, and the agent's (its secrets).
SYSTEM_PATHS = ("/proc", "/sys", "/dev", "/boot", "/etc", "/run", "/var/run", "/var/lib/docker")


@dataclass(frozen=True)
class Prepared:
    """What the launch gets from preparing: secret variables, mounts, and the registry credentials."""

    env: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    registry_auth: RegistryAuth | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Waiting:
    """A step is not ready yet; `reason` says which, in the spec's words."""

    reason: Reason


class Preparer:
    """Prepares attempts from the agent's data directory; `host_paths`, when given, are the only host paths
    (and what lies under them) that drives may mount. `store` holds the machine's copies of the catalogue's drives;
    `mounts` says whether its runtime mounts (docker) or gives a placed drive's path in the environment only
    (process)."""

    def __init__(
        self, data_dir: Path, host_paths: Iterable[str] = (), store: DriveStore | None = None, mounts: bool = True
    ) -> None:
        self.secrets_root = data_dir / "secrets"
        self.config_root = data_dir / "config"
        self._agent_root = str(data_dir.resolve())
        self._allowed = [str(Path(path).resolve()) for path in host_paths]
        self.store = store
        self._mounts = mounts

    def prepare(
        self, key: TaskRef, group: GroupSpec, catalogue: Mapping[str, Drive] | None = None
    ) -> Prepared | Waiting:
        """Every step in the spec's order: drives, then secrets, then the registry credential; then the files.
        `catalogue` holds the cluster's drives that the group mounts."""
        mounts: list[Mount] = []
        env: dict[str, str] = {}
        for drive in group.drives:
            if drive.drive is not None:
                placed = self._placed(drive, (catalogue or {}).get(drive.drive))
                if isinstance(placed, Waiting):
                    return placed
                env[drive_variable(drive.name)] = drive.mount_path if self._mounts else str(placed)
                if self._mounts:
                    mounts.append(Mount(target=drive.mount_path, source=str(placed), kind="bind", read_only=True))
                continue
            mount = self._drive(drive)
            if isinstance(mount, Waiting):
                return mount
            mounts.append(mount)
        files: list[tuple[SecretSpec, bytes]] = []
        for secret in group.secrets:
            value = self._secret_value(secret.name, secret.key)
            if value is None:
                return Waiting(R.WaitingForExternalSecret(secret=secret.name, key=secret.key))
            if secret.env is not None:
                env[secret.env] = _variable(secret, value)
            else:
                files.append((secret, value))
        auth = None
        if group.registry_secret is not None:
            auth = self._registry_auth(group.registry_secret)
            if auth is None:
                return Waiting(R.WaitingForRegistrySecret(secret=group.registry_secret))
        mounts += self._write_files(key, files)
        return Prepared(env=env, mounts=mounts, registry_auth=auth)

    @staticmethod
    def touches_files(group: GroupSpec) -> bool:
        """Whether preparing the group reads or writes a file (a drive, a secret, the registry credential); a group
        with none of them is prepared at once, with nothing to wait for."""
        return bool(group.drives or group.secrets or group.registry_secret is not None)

    def forget(self, keep: Iterable[str]) -> None:
        """Remove the files of every attempt but those in `keep` (slugs): attempts that ended need none."""
        forget_attempts(self.config_root, keep)

    # ---- steps ------------------------------------------------------------------------------------------------

    def _drive(self, drive: DriveSpec) -> Mount | Waiting:
        if drive.volume is not None:
            return Mount(target=drive.mount_path, source=drive.volume, kind="volume", read_only=drive.mounted_read_only)
        assert drive.host_path is not None
        refusal = self._refusal(drive.host_path)
        if refusal is not None:
            raise RuntimeFailure(R.InvalidTask(error=f"drive {drive.name}: host path {drive.host_path} {refusal}"))
        if not os.path.isdir(drive.host_path):
            why = "is not a directory" if os.path.lexists(drive.host_path) else "does not exist yet"
            return Waiting(R.WaitingForDataVolume(volume=drive.name, why=f"host path {drive.host_path} {why}"))
        return Mount(target=drive.mount_path, source=drive.host_path, kind="bind", read_only=drive.mounted_read_only)

    def _placed(self, spec: DriveSpec, drive: Drive | None) -> Path | Waiting:
        """Where a placed drive's data is on this machine: its source, on the machine that holds it; else the copy
        at the data location, filled first."""
        assert spec.drive is not None
        if drive is None:
            return Waiting(R.WaitingForDataVolume(volume=spec.drive, why=f"drive {spec.drive} does not exist"))
        store = self.store
        if store is not None and drive.node == store.node:
            source = Path(source_path(drive.source))
            if not source.is_dir():
                return Waiting(R.WaitingForDataVolume(volume=drive.name, why=f"its source {source} is not a directory"))
            return source
        if store is None:
            why = "this machine keeps no copies of drives"
            return Waiting(R.WaitingForDataVolume(volume=drive.name, why=why))
        copy = store.copy_of(drive)
        return copy if isinstance(copy, Path) else Waiting(copy)

    def _refusal(self, host_path: str) -> str | None:
        """Why this machine refuses to mount `host_path` (itself, or where its links lead), or None."""
        for path in dict.fromkeys([host_path, str(Path(host_path).resolve())]):
            if _under(path, [*SYSTEM_PATHS, self._agent_root]):
                return "is a system path or the agent's own" if path == host_path else f"leads to {path}, refused"
            if self._allowed and not _under(path, self._allowed):
                return f"is outside the host paths this machine allows ({', '.join(self._allowed)})"
        return None

    def _secret_value(self, name: str, key: str) -> bytes | None:
        """The key's value, or None while it is not on the machine (or not readable yet)."""
        try:
            return (self.secrets_root / name / key).read_bytes()
        except OSError:
            return None

    def _registry_auth(self, name: str) -> RegistryAuth | None:
        username = self._secret_value(name, "username")
        password = self._secret_value(name, "password")
        if username is None or password is None:
            return None
        text = (username.decode("utf-8", errors="replace").strip(), password.decode("utf-8", errors="replace"))
        return RegistryAuth(username=text[0], password=text[1].rstrip("\n"))

    def _write_files(self, key: TaskRef, files: list[tuple[SecretSpec, bytes]]) -> list[Mount]:
        """Copy each file secret into the attempt's config directory; mount it read-only where it was asked."""
        mounts = []
        directory = self.config_root / key.slug
        for index, (secret, value) in enumerate(files):
            assert secret.path is not None
            host_file = directory / f"{index}-{PurePosixPath(secret.path).name}"
            try:
                directory.mkdir(parents=True, exist_ok=True, mode=0o700)
                _write_atomically(host_file, value)
                host_file.chmod(0o444)  # the worker may run as any user of its image
            except OSError as err:
                raise RuntimeFailure(R.WritingConfigFailed(path=secret.path, error=err.strerror or str(err))) from err
            mounts.append(Mount(target=secret.path, source=str(host_file), kind="bind", read_only=True))
        return mounts


def _variable(secret: SecretSpec, value: bytes) -> str:
    """A secret's value as an environment variable: text without NUL bytes, kept exactly as written."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        text = "\0"
    if "\0" in text:
        error = f"secret {secret.name} (key {secret.key}) is not text and cannot be the variable {secret.env}"
        raise RuntimeFailure(R.InvalidTask(error=error))
    return text


def drive_variable(name: str) -> str:
    """The environment variable that tells a worker where a placed drive is: ASTRAEUS_DRIVE_<NAME>."""
    return "ASTRAEUS_DRIVE_" + name.upper().replace("-", "_")


def _under(path: str, roots: Iterable[str]) -> bool:
    if path == "/":
        return True
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write so that a reader (the container) sees the whole file or none of it; a retry rewrites it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
