"""Child-process side of the CUDA hand-off tests (spawned: CUDA cannot be forked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kv_support import SECRET

from disagg.engine.engine import Engine, EngineConfig, plan_kv
from disagg.engine.sequence import SequenceState
from disagg.kv import Transport, TransportConfig, create_transport


def engine_on(model_dir: Path, device: str, dtype: str, transport: Transport | None = None) -> Engine:
    """An engine on ``device``; its KV pool allocated by ``transport`` (as a pool's is) when given."""
    config = EngineConfig(model_dir=model_dir, device=device, dtype=dtype, kv_cache_mb=64)
    if transport is None:
        return Engine(config)
    layout, n = plan_kv(config)
    return Engine(config, kv_memory=transport.allocate_memory(n, layout.block_bytes))


def decode_importer(model_dir: str, dtype: str, prefix: str, conn: Any) -> None:
    """Import each (state, descriptor) received over CUDA IPC into an engine on cuda:0, decode it to
    the end, and answer (tokens, ack); ``None`` ends the process."""
    transport = create_transport("cuda_ipc", TransportConfig(secret=SECRET, prefix=prefix, checksum=True))
    engine = engine_on(Path(model_dir), "cuda:0", dtype, transport)
    try:
        while (msg := conn.recv()) is not None:
            state, descriptor = SequenceState.from_dict(msg[0]), msg[1]
            imported = engine.import_sequence(state, descriptor, transport)
            tokens: list[int] = []
            while engine.active_sequences():
                for out in engine.decode_step():
                    tokens.append(out.token_id)
            engine.free(imported.seq_id)
            conn.send((tokens, engine.usage().used))
    finally:
        engine.close()
        transport.close()
