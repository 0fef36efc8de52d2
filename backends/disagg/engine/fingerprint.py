"""What a KV cache means: the compatibility fingerprint every KV descriptor carries.

KV bytes are only meaningful to an engine that computes attention with the same weights over the same
layout. A prefill pool of version N handing KV to a decode pool of version N+1 whose checkpoint,
KV dtype or block size changed would decode garbage into silently wrong text. So each engine stamps
its KV layout with a fingerprint (``KVLayout.fingerprint``) and refuses, before it allocates or copies
anything, KV whose fingerprint is not its own (``disagg.kv.errors.IncompatibleKV``).

    fingerprint = BLAKE2b-128(checkpoint id, layers, KV heads, head dim, KV dtype, block size,
                              KV_FORMAT)

- The **checkpoint id** is a BLAKE2b-128 of the checkpoint's ``config.json`` and the full contents of
  its ``*.safetensors`` files, in name order. Hashing SmolLM2's 514 MB takes about 3 s on one core, so
  the id is remembered in this project's state folder (``$XDG_STATE_HOME/triton-disagg/
  checkpoints.json``, never in the checkpoint's folder), keyed by each file's path, size,
  modification time and inode: a file replaced or rewritten is hashed again.
- **KV_FORMAT** is the engine's KV encoding version: bump it when the engine changes what it writes
  into a block (rotary layout, scaling), so that KV from an older engine is refused too.
- The compute dtype is *not* part of it: a prefill pool computing in fp32 may hand bf16 KV to a bf16
  decode pool (their KV dtype is the same).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from disagg.kv.layout import KVLayout
from disagg.kv.secret import default_secret_path
from disagg.statefile import read_json_object, write_private

KV_FORMAT = 1
CACHE_FILE = "checkpoints.json"
MAX_REMEMBERED = 256  # checkpoints remembered; the oldest are forgotten (hashed again if they come back)
_CHUNK = 1 << 20


def default_cache_path() -> Path:
    """``$XDG_STATE_HOME/triton-disagg/checkpoints.json`` (``~/.local/state`` when unset)."""
    return default_secret_path().parent / CACHE_FILE


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The files whose bytes define a checkpoint's KV: config.json and the weights, in name order."""
    folder = Path(model_dir)
    return [folder / "config.json", *sorted(folder.glob("*.safetensors"))]


def _identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _digest(files: Iterable[Path]) -> str:
    outer = hashlib.blake2b(digest_size=16)
    for path in files:
        inner = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                inner.update(chunk)
        outer.update(path.name.encode() + b"\0" + inner.digest())
    return outer.hexdigest()


def checkpoint_id(model_dir: Path, cache: Path | None = None) -> str:
    """The content hash of a checkpoint folder (32 hex digits), remembered in ``cache``.

    An unreadable or unwritable cache only costs the hashing again."""
    files = checkpoint_files(model_dir)
    key = "\n".join(_identity(p) for p in files)
    path = cache if cache is not None else default_cache_path()
    known = read_json_object(path)
    if isinstance(known.get(key), str):
        return known[key]
    value = _digest(files)
    kept = [(k, v) for k, v in known.items() if isinstance(v, str)][-(MAX_REMEMBERED - 1) :]
    known = {**dict(kept), key: value}
    with contextlib.suppress(OSError):  # a read-only home: hashed every time, still correct
        write_private(path, json.dumps(known, sort_keys=True))
    return value


def kv_fingerprint(checkpoint: str, layout: KVLayout) -> str:
    """The fingerprint of KV in ``layout`` computed from the checkpoint with id ``checkpoint``."""
    fields = (
        checkpoint,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.dtype,
        layout.block_size,
        KV_FORMAT,
    )
    return hashlib.blake2b("|".join(map(str, fields)).encode(), digest_size=16).hexdigest()
