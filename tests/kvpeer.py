"""Child-process sides of KV hand-off tests (run with multiprocessing spawn or as a script).

Each side talks to the test over a Pipe (or stdin/stdout when run as a script) with small
tuples of plain values; tokens are bytes. Nothing here sleeps to synchronise.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from typing import Any

import torch

from disagg.kv import KVError, KVLayout, TransportConfig, create_transport


def make_transport(kind: str, prefix: str, secret: bytes, **extra: Any):
    cfg = TransportConfig(secret=secret, prefix=prefix, checksum=True, transfer_timeout_s=10.0, **extra)
    if kind == "faulty":
        from disagg.kv.faulty import FaultyTransport

        return FaultyTransport(create_transport("shm", cfg))
    return create_transport(kind, cfg)


def fill(pool: torch.Tensor, seed: int) -> None:
    """Seeded bytes that differ from block to block, cheap even for 256 MiB pools."""
    g = torch.Generator().manual_seed(seed)
    period = (1 << 20) + 4099  # not a multiple of any block size: every block differs
    base = torch.randint(0, 256, (period,), dtype=torch.uint8, generator=g)
    flat = pool.view(-1)
    for start in range(0, flat.numel(), period):
        chunk = flat[start : start + period]
        chunk.copy_(base[: chunk.numel()])


def digest(pool: torch.Tensor, ids: list[int]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for b in ids:
        h.update(pool[b].cpu().numpy().tobytes())
    return h.hexdigest()


def importer_main(kind: str, prefix: str, secret: bytes, conn: Any, layout: dict, num_blocks: int) -> None:
    """Import every token received into blocks [0, n); reply (status, digest-or-error). Each import's
    ack goes back through the transport itself."""
    t = make_transport(kind, prefix, secret)
    L = KVLayout.from_dict(layout)
    pool = t.allocate_memory(num_blocks, L.block_bytes)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            if msg == "die":
                os._exit(0)  # the importer vanishes before pulling
            ids = list(range(KVLayout.from_dict(layout).with_tokens(msg[1]).num_blocks))
            try:
                t.import_blocks(msg[0], pool, ids)  # its ack goes back through the transport
                conn.send(("ok", digest(pool, ids)))
            except KVError as e:
                conn.send(("err", type(e).__name__, str(e)))
    finally:
        t.close()


def exporter_main(
    kind: str, prefix: str, secret: bytes, conn: Any, layout: dict, num_blocks: int, seed: int
) -> None:
    """Export blocks on request ("export", ids, tokens) -> token; ("held",) -> lease count after poll."""
    t = make_transport(kind, prefix, secret)
    L = KVLayout.from_dict(layout)
    pool = t.allocate_memory(num_blocks, L.block_bytes)
    fill(pool, seed)
    conn.send(("ready", os.getpid()))
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            if msg[0] == "export":
                conn.send(
                    ("token", t.export_blocks(pool, msg[1], L.with_tokens(msg[2])), digest(pool, msg[1]))
                )
            elif msg[0] == "held":
                deadline = time.monotonic() + msg[1]
                while t.held_leases() > msg[2] and time.monotonic() < deadline:
                    t.poll()
                conn.send(("held", t.held_leases()))
    finally:
        t.close()


def netns_side(role: str, layout_json: str) -> None:
    """Script form for the network-namespace test: our stdout lines start with "KV " (NIXL logs there too)."""
    import json

    secret = os.environ["DISAGG_SECRET"].encode()
    L = KVLayout.from_dict(json.loads(layout_json))
    t = make_transport("nixl", "netns", secret)
    pool = t.allocate_memory(L.num_blocks, L.block_bytes)
    ids = list(range(L.num_blocks))
    if role == "export":
        fill(pool, 7)
        print("KV", t.export_blocks(pool, ids, L).decode(), digest(pool, ids), flush=True)
        sys.stdin.readline()  # importer finished
        deadline = time.monotonic() + 20
        while t.held_leases() and time.monotonic() < deadline:
            t.poll()
        print("KV held", t.held_leases(), flush=True)
    else:
        token = sys.stdin.readline().strip().encode()
        t.import_blocks(token, pool, ids)
        print("KV digest", digest(pool, ids), flush=True)
    t.close()


if __name__ == "__main__":
    netns_side(sys.argv[1], sys.argv[2])
