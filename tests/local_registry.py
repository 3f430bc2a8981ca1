"""A registry on loopback for tests, so that a pull can succeed with no registry reachable: the Docker Registry
HTTP API v2, read-only, serving images of one layer (a rootfs tar) by repository and tag. The engine pulls from
127.0.0.1 over plain HTTP (loopback registries are insecure ones by default)."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG = "application/vnd.docker.container.image.v1+json"
LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class LocalRegistry:
    """`add(repository, tag)` serves the rootfs as that image; `start()` listens on a free port, `stop()` ends."""

    def __init__(self, rootfs_tar: Path) -> None:
        tar = rootfs_tar.read_bytes()
        layer = gzip.compress(tar, mtime=0)
        config = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Cmd": ["/bin/sh"]},
                "rootfs": {"type": "layers", "diff_ids": [_digest(tar)]},
            }
        ).encode()
        self.manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": MANIFEST,
                "config": {"mediaType": CONFIG, "size": len(config), "digest": _digest(config)},
                "layers": [{"mediaType": LAYER, "size": len(layer), "digest": _digest(layer)}],
            }
        ).encode()
        self.blobs = {_digest(config): config, _digest(layer): layer}
        self.tags: set[tuple[str, str]] = set()
        self.pulls: list[str] = []  # every manifest asked for by tag, as repository:tag
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def add(self, repository: str, tag: str) -> str:
        """Serve the image as repository:tag; returns the name to pull it by."""
        self.tags.add((repository, tag))
        return f"{self.address}/{repository}:{tag}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                found = registry._find(self.path)
                if found is None:
                    self._send(
                        404, b'{"errors":[{"code":"NAME_UNKNOWN","message":"not found"}]}', "application/json", body
                    )
                    return
                data, kind = found
                self._send(200, data, kind, body)

            def _send(self, status: int, data: bytes, kind: str, body: bool) -> None:
                self.send_response(status)
                self.send_header("Docker-Distribution-API-Version", "registry/2.0")
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                if status == 200:
                    self.send_header("Docker-Content-Digest", _digest(data))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass  # quiet: the engine's requests are not the test's output

        return Handler

    def _find(self, path: str) -> tuple[bytes, str] | None:
        if path == "/v2/":
            return b"{}", "application/json"
        manifest = re.fullmatch(r"/v2/(.+)/manifests/([^/]+)", path)
        if manifest:
            repository, reference = manifest.groups()
            if (repository, reference) in self.tags:
                self.pulls.append(f"{repository}:{reference}")
                return self.manifest, MANIFEST
            if reference == _digest(self.manifest):
                return self.manifest, MANIFEST
            return None
        blob = re.fullmatch(r"/v2/(.+)/blobs/([^/]+)", path)
        if blob and blob.group(2) in self.blobs:
            return self.blobs[blob.group(2)], "application/octet-stream"
        return None
