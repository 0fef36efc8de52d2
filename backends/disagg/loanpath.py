"""Where core loans' segments live and how they are named (``disagg.engine.loan``); torch-free, so
that the server launcher can sweep a dead server's segments (``disagg.server``) as it does its KV
regions."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

SHM = Path("/dev/shm")
ENV_SERVER_HTTP = "DISAGG_SERVER_HTTP"  # disagg.serverconfig's: the server a pool process serves in


def _server_tag(server_http: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", server_http)


def loan_scope(prefix: str, version: int = 1, server_http: str | None = None) -> str:
    """What names a deployment's loan segments: its prefix, inside a server the server's HTTP endpoint
    (``DISAGG_SERVER_HTTP``, read here unless given), so that two servers on one machine never share
    a loan, and the pools' model version, so that two versions loaded side by side in a rollout pair
    within their own."""
    server = os.environ.get(ENV_SERVER_HTTP, "") if server_http is None else server_http
    where = f"-{_server_tag(server)}" if server else ""
    return f"{prefix}{where}-v{version}"


def segment_name(scope: str, core: int) -> str:
    return f"{scope}-loan-core{core}"


def sweep(prefix: str, server_http: str, directory: Path = SHM) -> list[str]:
    """Remove the loan segments of the server at ``server_http`` (call it once its processes are all
    gone: a pool killed, or a server that exited before its pools closed, leaves them); the names
    removed."""
    pattern = re.compile(rf"^{re.escape(prefix)}-{re.escape(_server_tag(server_http))}-v\d+-loan-core\d+$")
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if pattern.match(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                removed.append(entry.name)
    return removed
