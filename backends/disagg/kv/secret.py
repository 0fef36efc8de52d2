"""The per-deployment secret that signs descriptors and acks.

One process of a deployment creates it at first start (random, file mode 0600); every
other process on the host reads the same file. Hosts that do not share a file system get
the same value through the ``DISAGG_SECRET`` environment variable, which wins over the file.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from disagg.kv.errors import SecretError

ENV_VAR = "DISAGG_SECRET"
MIN_SECRET_BYTES = 32


def default_secret_path() -> Path:
    """``$XDG_STATE_HOME/triton-disagg/secret`` (``~/.local/state`` when unset)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "triton-disagg" / "secret"


def load_secret(path: str | os.PathLike[str] | None = None, env_var: str = ENV_VAR) -> bytes:
    """Return the deployment secret: from ``env_var`` if set, else from ``path``, creating it.

    Creation is race-free between processes (``O_EXCL``); a reader that loses the race reads
    the winner's file. A file readable by group or others is refused rather than used.
    """
    from_env = os.environ.get(env_var)
    if from_env is not None:
        value = from_env.strip().encode()
        if len(value) < MIN_SECRET_BYTES:
            raise SecretError(f"the secret in the environment is shorter than {MIN_SECRET_BYTES} bytes")
        return value
    target = Path(path) if path is not None else default_secret_path()
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read(target)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(MIN_SECRET_BYTES) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return _read(target)


def _read(target: Path) -> bytes:
    try:
        info = target.stat()
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError("the secret file is accessible to group or others (want mode 0600)")
        value = target.read_bytes().strip()
    except OSError:
        raise SecretError("the secret file cannot be read") from None
    if len(value) < MIN_SECRET_BYTES:
        # Another process may be between O_EXCL and write; its file is shorter for an instant.
        raise SecretError(f"the secret file holds fewer than {MIN_SECRET_BYTES} bytes")
    return value
