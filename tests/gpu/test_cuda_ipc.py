"""The CUDA IPC transport through its real boundary (``TorchCudaIpc``): two processes on one GPU.

Skipped without CUDA (``conftest.py``); run on a lent GPU by ``perf/gpu_check.sh``.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kv_support import SECRET, small_layout
from kvpeer import digest, fill, importer_main, make_transport

from disagg.kv import ChecksumMismatch, KVLayout

CTX = mp.get_context("spawn")
TIMEOUT_S = 120


def _importer(prefix: str, layout: dict, n: int, conn) -> None:
    importer_main("cuda_ipc", prefix, SECRET, conn, layout, n)


@contextmanager
def _peers(layout: KVLayout, importer_blocks: int) -> Iterator[tuple[Any, Any]]:
    """(exporting transport here, pipe to an importing process on the same GPU); both end cleanly."""
    prefix = "g" + secrets.token_hex(4)
    exp = make_transport("cuda_ipc", prefix, SECRET)
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_importer, args=(prefix, layout.to_dict(), importer_blocks, child), daemon=True)
    proc.start()
    try:
        yield exp, parent
        parent.send(None)
        proc.join(TIMEOUT_S)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        exp.close()


def _recv(conn):
    assert conn.poll(TIMEOUT_S), "the importing process did not answer"
    return conn.recv()


def test_blocks_cross_processes_bit_for_bit_and_the_lease_ends() -> None:
    layout = small_layout(64)
    with _peers(layout, 16) as (exp, importer):
        pool = exp.allocate_memory(32, layout.block_bytes)
        assert pool.device.type == "cuda"
        fill(pool, 3)
        for ids in ([0, 1, 2, 3, 4, 5, 6, 7], [20, 9, 31, 8, 10, 11, 12, 13]):
            importer.send((exp.export_blocks(pool, ids, layout), 64))
            status, got, _ack = _recv(importer)
            assert status == "ok" and got == digest(pool, ids)
            exp.poll()  # the importer's ack, written into our region, ends the lease
            assert exp.held_leases() == 0


def test_a_corrupted_block_is_refused_across_processes() -> None:
    layout = small_layout(16)
    with _peers(layout, 8) as (exp, importer):
        pool = exp.allocate_memory(8, layout.block_bytes)
        fill(pool, 5)
        token = exp.export_blocks(pool, [0, 1], layout)
        pool[1, 7] ^= 0xFF  # written after export, before the pull: the checksum must catch it
        importer.send((token, 16))
        status, name, _ = _recv(importer)
        assert status == "err" and name == ChecksumMismatch.__name__
