"""Mutual TLS on the pools' gRPC links between hosts (torch-free).

A folder holds three PEM files: ``ca.pem``, the certificate authority that signs every host's
certificate; ``cert.pem``, this host's certificate (with the names or addresses the frontend dials it
by, as subject alternative names); ``key.pem``, its private key. A pool server (``disagg serve --role
prefill|decode``) serves gRPC with it and asks every client for a certificate the CA signed; the
frontend's orchestrators dial the pools with its own. Triton 2.51's HTTP endpoint has no TLS: a pool
role keeps it on loopback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "cert.pem", "key.pem"


@dataclass(frozen=True)
class GrpcTls:
    """The TLS folder of one host; ValueError naming a file that is missing or unreadable."""

    folder: Path

    def __post_init__(self) -> None:
        if not isinstance(self.folder, Path) or not self.folder.is_absolute():
            raise ValueError("tls: the folder must be an absolute path")
        for name in (CA_FILE, CERT_FILE, KEY_FILE):
            path = self.folder / name
            if not path.is_file() or not os.access(path, os.R_OK):
                raise ValueError(f"tls: {path} is missing or unreadable (the folder holds {CA_FILE}, "
                                 f"{CERT_FILE} and {KEY_FILE})")  # fmt: skip

    @property
    def ca(self) -> Path:
        return self.folder / CA_FILE

    @property
    def cert(self) -> Path:
        return self.folder / CERT_FILE

    @property
    def key(self) -> Path:
        return self.folder / KEY_FILE

    def server_args(self) -> list[str]:
        """tritonserver's flags: gRPC over TLS, every client's certificate checked against the CA."""
        return [
            "--grpc-use-ssl=true",
            "--grpc-use-ssl-mutual=true",
            f"--grpc-server-cert={self.cert}",
            f"--grpc-server-key={self.key}",
            f"--grpc-root-cert={self.ca}",
        ]

    def client_options(self) -> dict[str, Any]:
        """``tritonclient.grpc`` (and its aio twin) keyword arguments: the server checked against the CA,
        this host's certificate shown to it."""
        return {
            "ssl": True,
            "root_certificates": str(self.ca),
            "private_key": str(self.key),
            "certificate_chain": str(self.cert),
        }


def grpc_tls(folder: str | Path | None) -> GrpcTls | None:
    """The TLS of a folder given as text ("" or None: plain gRPC)."""
    return GrpcTls(Path(folder)) if folder else None
