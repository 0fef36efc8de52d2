"""Child-process side of the CUDA hand-off tests (spawned: CUDA cannot be forked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kv_support import SECRET

from disagg.engine.engine import Engine, EngineConfig, plan_kv
from disagg.engine.sequence import SequenceState
from disagg.kv import TransportConfig, create_transport


def decode_importer(model_dir: str, dtype: str, prefix: str, conn: Any) -> None:
    """Import each (state, descriptor) received over CUDA IPC into an engine on cuda:0, decode it to
    the end, and answer (tokens, ack); ``None`` ends the process."""
    transport = create_transport("cuda_ipc", TransportConfig(secret=SECRET, prefix=prefix, checksum=True))
    config = EngineConfig(model_dir=Path(model_dir), device="cuda:0", dtype=dtype, kv_cache_mb=64)
    layout, n = plan_kv(config)
    engine = Engine(config, kv_memory=transport.allocate_memory(n, layout.block_bytes))
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
