"""KV hand-off bandwidth between two processes, next to a plain memcpy of the same size.

Run with no arguments. For every transport that runs here (shm, nixl; cuda_ipc where CUDA is)
and 1, 16, 64, 256 MiB it times whole hand-offs: from the KV sitting in the exporter's
blocks to the KV sitting in the importer's blocks, i.e. export (lease + signed descriptor)
-> descriptor to the importer process -> verify + one copy -> ack back -> lease released.
Both pools are allocated by the transport, as the engine does. The baseline is one torch
``copy_`` or numpy ``copyto`` (the faster) of the same size between two warm buffers,
measured in the same run; for cuda_ipc, one device-to-device ``copy_`` on the GPU.

Prints one JSON object per line on stdout and writes perf/results/kv_transfer.{md,json}.
gbps = 10^9 bytes per second (median of the repetitions).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from disagg.kv import KVLayout, TransportConfig, create_transport
from disagg.kv.transport import Transport

MIB = 1 << 20
# 8 layers x 8 kv heads x 128 dims x fp16 x 32 tokens = 1 MiB blocks.
BLOCK = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", block_size=32)
SECRET = b"kv-transfer-bench-secret-0123456789"


def config(prefix: str) -> TransportConfig:
    return TransportConfig(secret=SECRET, prefix=prefix, checksum=False, ttl_s=60.0)


QUIET = "nixl-quiet"
"""NIXL as the pools run it (``disagg.pool.instance.transport_options``): no progress thread on
either side; the exporter's transfers are progressed by its reaper, every 10 ms."""


def make(kind: str, prefix: str) -> Transport:
    if kind != QUIET:
        return create_transport(kind, config(prefix))
    from disagg.kv.nixl import NixlConfig

    return create_transport("nixl", config(prefix), nixl=NixlConfig(progress_thread=False))


def importer(kind: str, prefix: str, num_blocks: int, conn) -> None:
    t = make(kind, prefix)
    pool = t.allocate_memory(num_blocks, BLOCK.block_bytes)
    pool.fill_(0)  # fault the pages in before timing, as a running engine would have
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        token, n = msg
        t.import_blocks(token, pool, list(range(n)))  # its ack goes back through the transport
        conn.send("done")
    t.close()


def bench_transport(kind: str, sizes: list[int], reps: int) -> list[dict]:
    prefix = "bench" + str(int(time.time()) % 100000)
    ctx = mp.get_context("spawn")
    num_blocks = max(sizes) // MIB
    t = make(kind, prefix)
    if kind == QUIET:
        t.start_reaper(0.01)  # as a prefill pool's
    pool = t.allocate_memory(num_blocks, BLOCK.block_bytes)
    pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8))
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=importer, args=(kind, prefix, num_blocks, child), daemon=True)
    proc.start()
    if not parent.poll(120) or parent.recv() != "ready":
        raise RuntimeError(f"{kind} importer did not start")
    rows = []
    try:
        for size in sizes:
            n = size // MIB
            layout = BLOCK.with_tokens(n * BLOCK.block_size)
            times = []
            base = []
            copies = _memcpy_candidates(size, pool.device)
            for i in range(reps + 2):  # two warm-ups (first mapping, first registration)
                start = time.perf_counter()
                token = t.export_blocks(pool, list(range(n)), layout)
                parent.send((token, n))
                parent.recv()
                while t.held_leases():  # until the native ack is taken in: the lease is released
                    t.poll()
                elapsed = time.perf_counter() - start
                # The baseline is interleaved with the hand-offs so both see the same machine load.
                copy_times = []
                for copy in copies:
                    c0 = time.perf_counter()
                    copy()
                    copy_times.append(time.perf_counter() - c0)
                if i >= 2:
                    times.append(elapsed)
                    base.append(copy_times)
            best_base = min(statistics.median(col) for col in zip(*base, strict=True))
            rows.append(
                {
                    "transport": kind,
                    "bytes": size,
                    "seconds": statistics.median(times),
                    "memcpy_seconds": best_base,
                }
            )
    finally:
        parent.send(None)
        proc.join(60)
        t.close()
    return rows


def _memcpy_candidates(size: int, device: torch.device) -> list:
    """One plain copy of ``size`` bytes between warm buffers: torch ``copy_`` and numpy ``copyto``; on
    a GPU, one device-to-device ``copy_``, waited for."""
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    if device.type == "cuda":
        src, dst = src.to(device), torch.zeros(size, dtype=torch.uint8, device=device)
        return [lambda: (dst.copy_(src), torch.cuda.synchronize(device))]
    dst = torch.zeros(size, dtype=torch.uint8)
    src_np, dst_np = src.numpy(), dst.numpy()
    return [lambda: dst.copy_(src), lambda: np.copyto(dst_np, src_np)]


def available() -> list[str]:
    kinds = ["shm"]
    try:
        import nixl_cu12._api  # noqa: F401

        kinds += ["nixl", QUIET]
    except ImportError:
        print("nixl not installed: skipped", file=sys.stderr)
    if torch.cuda.is_available():
        kinds.append("cuda_ipc")
    else:
        print("cuda_ipc: needs a GPU, not measured here", file=sys.stderr)
    return kinds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--transports", nargs="+", default=None)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    sizes = [s * MIB for s in args.sizes_mib]
    results = []
    for kind in args.transports or available():
        rows = bench_transport(kind, sizes, args.reps)
        for row in rows:
            base = row["memcpy_seconds"]  # the faster of the two plain copies (median of each)
            out = {
                "transport": row["transport"],
                "bytes": row["bytes"],
                "gbps": round(row["bytes"] / row["seconds"] / 1e9, 3),
                "memcpy_gbps": round(row["bytes"] / base / 1e9, 3),
            }
            out["ratio"] = round(out["gbps"] / out["memcpy_gbps"], 3)
            print(json.dumps(out), flush=True)
            results.append(out)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    (args.out / "kv_transfer.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1) + "\n"
    )
    lines = [
        "# KV hand-off between two processes vs. one memcpy (same run)",
        "",
        f"torch {meta['torch']}, {meta['threads']} threads; "
        "hand-off = export + descriptor + verify + copy + ack.",
        "",
        "| transport | MiB | GB/s | memcpy GB/s | ratio |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['transport']} | {r['bytes'] // MIB} | {r['gbps']:.2f} | {r['memcpy_gbps']:.2f} "
        f"| {r['ratio']:.0%} |"
        for r in results
    ]
    (args.out / "kv_transfer.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
