"""A real OCI registry on loopback (Debian's docker-registry, the CNCF
distribution registry) and OCI images made here, byte by byte, pushed to
it with skopeo: what the registry tests pull."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from .processes import free_port

Files = dict[str, bytes | None]  # path -> content; None: a directory


# bcrypt of "corral-test" (docker-registry's htpasswd wants bcrypt).
HTPASSWD = "corral:$2b$05$ehoz57341ir.wwj3gHXNCuLlLLNHrr99KmCQQx6EosuzM68hmdRi6"
USER, PASSWORD = "corral", "corral-test"


def trusted_cert(root: Path, name: str, port: int) -> tuple[Path, Path]:
    """A self-signed certificate for `name`, which skopeo (containers' certs.d)
    trusts for `name:port` until certs_dir(name, port) is removed."""
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName=DNS:{name}"],
                   check=True, capture_output=True)  # fmt: skip
    certs_dir(name, port).mkdir(parents=True, exist_ok=True)
    shutil.copy(cert, certs_dir(name, port) / "ca.crt")
    return cert, key


def certs_dir(name: str, port: int) -> Path:
    return Path("/etc/containers/certs.d") / f"{name}:{port}"


class Registry:
    def __init__(self, root: Path, *, auth: bool = False, tls_name: str | None = None) -> None:
        """`tls_name`: serve HTTPS with a certificate for that name, which
        skopeo trusts for `tls_name:port` (containers' certs.d) while it runs."""
        self.root = root
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.auth = auth
        self.tls_name = tls_name
        self.proc: subprocess.Popen[bytes] | None = None

    def authfile(self, password: str = PASSWORD) -> Path:
        """A docker login-style credentials file for this registry."""
        import base64

        path = self.root / f"auth-{password}.json"
        token = base64.b64encode(f"{USER}:{password}".encode()).decode()
        path.write_text(json.dumps({"auths": {self.host: {"auth": token}}}))
        return path

    def start(self) -> None:
        if shutil.which("docker-registry") is None or shutil.which("skopeo") is None:
            pytest.fail("docker-registry or skopeo is missing: ./scripts/install.sh installs them")
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {self.root / 'data'}\nhttp:\n  addr: {self.host}\n"
            "  secret: corral-tests\n"
        )
        if self.tls_name is not None:
            cert, key = trusted_cert(self.root, self.tls_name, self.port)
            with open(config, "a") as f:
                f.write(f"  tls:\n    certificate: {cert}\n    key: {key}\n")
        if self.auth:
            (self.root / "htpasswd").write_text(HTPASSWD + "\n")
            with open(config, "a") as f:
                f.write(f"auth:\n  htpasswd:\n    realm: corral\n"
                        f"    path: {self.root / 'htpasswd'}\n")  # fmt: skip
        log = open(self.root / "registry.log", "ab")  # noqa: SIM115 (held while it runs)
        self.proc = subprocess.Popen(["docker-registry", "serve", str(config)],
                                     stdout=log, stderr=log)  # fmt: skip
        for _ in range(100):
            try:
                scheme = "https" if self.tls_name else "http"
                answer = httpx.get(f"{scheme}://{self.host}/v2/", verify=False)
                if answer.status_code in (200, 401):
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("docker-registry did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
        if self.tls_name is not None:
            shutil.rmtree(certs_dir(self.tls_name, self.port), ignore_errors=True)

    def push(self, layout: Path, name: str, *options: str) -> None:
        creds = ["--dest-creds", f"{USER}:{PASSWORD}"] if self.auth else []
        subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", *creds, *options,
                        f"oci:{layout}:img", f"docker://{self.host}/{name}"], check=True,
                       capture_output=True)  # fmt: skip

    def blob_file(self, digest: str) -> Path:
        hexd = digest.removeprefix("sha256:")
        return self.root / "data/docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


def layer_tar(files: Files) -> bytes:
    """An uncompressed layer tarball: name -> bytes, or None for a directory."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.mtime = 0
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                t.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                t.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def oci_image(
    dest: Path,
    layers: list[Files],
    config: dict[str, Any],
    *,
    platforms: dict[str, list[Files]] | None = None,
) -> dict[str, Any]:
    """An OCI image layout at dest with these layers (gzip), bottom first;
    the digests of what it holds. With `platforms` (arch -> extra top
    layer), an image index of one manifest per platform."""
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    if platforms:
        entries = []
        for arch, extra in platforms.items():
            sub = oci_image(dest / f"_{arch}", [*layers, *extra], {**config, "arch": arch})
            for blob in (dest / f"_{arch}" / "blobs" / "sha256").iterdir():
                shutil.copy(blob, blobs / blob.name)
            entries.append({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                            "digest": sub["manifest"], "size": sub["manifest_size"],
                            "platform": {"architecture": arch, "os": "linux"}})  # fmt: skip
            shutil.rmtree(dest / f"_{arch}")
        index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                 "manifests": entries}  # fmt: skip
        data = json.dumps(index).encode()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        top = {"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.index.v1+json", "digest": "sha256:" + digest,
            "size": len(data), "annotations": {"org.opencontainers.image.ref.name": "img"}}]}  # fmt: skip
        (dest / "index.json").write_text(json.dumps(top))
        (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        return {"index": "sha256:" + digest}

    def put(data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return "sha256:" + digest, len(data)

    descs, diff_ids = [], []
    for files in layers:
        raw = layer_tar(files)
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
        digest, size = put(gzip.compress(raw, mtime=0))
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                      "digest": digest, "size": size})  # fmt: skip
    cfg = {"architecture": "amd64", "os": "linux", "config": config,
           "rootfs": {"type": "layers", "diff_ids": diff_ids}}  # fmt: skip
    cfg_digest, cfg_size = put(json.dumps(cfg).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": cfg_digest, "size": cfg_size},
                "layers": descs}  # fmt: skip
    arch = cfg["config"].pop("arch", "amd64")
    cfg["architecture"] = arch
    cfg_digest, cfg_size = put(json.dumps(cfg).encode())
    manifest["config"] = {"mediaType": "application/vnd.oci.image.config.v1+json",
                          "digest": cfg_digest, "size": cfg_size}  # fmt: skip
    m_digest, m_size = put(json.dumps(manifest).encode())
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": m_digest,
        "size": m_size, "annotations": {"org.opencontainers.image.ref.name": "img"}}]}  # fmt: skip
    (dest / "index.json").write_text(json.dumps(index))
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return {"manifest": m_digest, "manifest_size": m_size, "layers": [d["digest"] for d in descs],
            "diff_ids": diff_ids}  # fmt: skip
