"""A machine's WireGuard key: made once, readable by its owner alone, the same one after a restart."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import pytest

from activities.agent.mesh import private_key, public_key
from activities.agent.wireguard import missing


def test_the_key_is_made_once_readable_by_its_owner_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "mesh" / "private.key"
    made = private_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert public_key(private_key(path)) == public_key(made)  # a restarted agent has the same key
    assert len(base64.b64decode(public_key(made))) == 32


@pytest.mark.skipif(missing(None) is not None, reason="no WireGuard here (make test installs wireguard-tools)")
def test_its_public_key_is_the_one_wireguard_derives(tmp_path: Path) -> None:
    path = tmp_path / "private.key"
    derived = subprocess.run(
        ["wg", "pubkey"], input=base64.b64encode(private_key(path).private_bytes_raw()) + b"\n", capture_output=True
    )
    assert derived.stdout.decode().strip() == public_key(private_key(path))
