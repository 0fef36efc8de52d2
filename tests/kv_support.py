"""Constants and small factories shared by the KV transport tests (a uniquely named module: test files
import it directly, which a `conftest` module cannot be relied on for)."""

from __future__ import annotations

from disagg.kv import KVLayout

SECRET = b"conformance-secret-" + b"x" * 16
KINDS = ["fake", "shm", "nixl", "faulty", "cuda_ipc"]
# faulty is shm with hook points: across processes it adds nothing shm does not show (its faults are
# tested in-process, and live in tests/integration/test_serving_injected_faults.py)
CROSS_PROCESS_KINDS = ["shm", "nixl"]


class Clock:
    """A wall clock the test drives by hand."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def small_layout(tokens: int = 32) -> KVLayout:
    # 2 layers x 2 kv heads x 16 dims x fp16 x 8 tokens = 2 KiB blocks.
    return KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=8, num_tokens=tokens
    )
