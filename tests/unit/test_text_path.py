"""The processes that never run the engine never load torch.

The orchestrator, preprocessing and postprocessing stubs only tokenize, route and detokenize; the
launcher (``disagg serve``) only supervises tritonserver. Loading torch there would cost each of
those processes seconds of start-up and hundreds of MB. Each check imports the modules in a fresh
interpreter (this one has torch loaded by other tests) and names the import chain that pulled torch
in, if any.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import disagg.kv

# Run in the child: records, at the first import of torch, which modules were executing (innermost
# last), then imports the modules named on the command line and reports.
PROBE = r"""
import importlib, json, sys

class TorchWatch:
    chain = None

    def find_spec(self, name, path=None, target=None):
        if TorchWatch.chain is None and name.split(".")[0] == "torch":
            chain, frame = [], sys._getframe(1)
            while frame is not None:
                module = frame.f_globals.get("__name__", "?")
                if not module.startswith(("importlib", "_frozen_importlib", "__main__")):
                    if not chain or chain[-1] != module:
                        chain.append(module)
                frame = frame.f_back
            TorchWatch.chain = [*reversed(chain), name]
        return None

sys.meta_path.insert(0, TorchWatch())
for module in sys.argv[1:]:
    importlib.import_module(module)
print(json.dumps({"torch": "torch" in sys.modules, "chain": TorchWatch.chain}))
"""

CASES = {
    "text path": [
        "disagg.triton.entry",
        "disagg.triton.orchestrator_model",
        "disagg.triton.text_model",
        "disagg.serving.orchestrator",
    ],
    "launcher": ["disagg.server", "disagg_tools.cli"],
    "openai front end": ["disagg.openai.server", "disagg.openai.app", "disagg.openai.launcher"],
    "kv package": ["disagg.kv", "disagg.kv.errors", "disagg.kv.stale"],
    "pool core": [
        "disagg.scheduling",
        "disagg.protocol.messages",
        "disagg.pool.runner",
        "disagg.engine.backend",
        "disagg.triton.wire",
        "disagg.config",
        "disagg.role",
    ],
}


def import_in_child(modules: list[str]) -> dict[str, object]:
    """Import ``modules`` in a fresh interpreter on this one's path; whether torch got loaded, and by
    which chain of modules."""
    path = os.pathsep.join(p for p in sys.path if p)  # tests/ (pytest's pythonpath) and backends
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_modules_import_without_torch(case: str) -> None:
    report = import_in_child(CASES[case])
    chain = " -> ".join(report["chain"] or [])
    assert not report["torch"], f"{case}: torch was imported by {chain}"


def test_kv_transport_names_load_on_first_use() -> None:
    """The lazy names of ``disagg.kv`` are the transport module's, and the built-in kinds are known
    however the registry is reached."""
    from disagg.kv import transport

    assert disagg.kv.TransportConfig is transport.TransportConfig
    assert disagg.kv.create_transport is transport.create_transport
    assert transport.transport_kinds() == ["cuda_ipc", "fake", "nixl", "shm"]
    assert set(disagg.kv.__all__) <= set(dir(disagg.kv))
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = disagg.kv.no_such_name
