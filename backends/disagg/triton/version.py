"""A pool model's version folder: which checkpoint it serves, and the probe it must pass first.

    model_repository/decode/config.pbtxt
    model_repository/decode/1/            version 1: the server's model ($MODEL_DIR)
    model_repository/decode/2/version.json  {"checkpoint": "/models/b", "probe": {...}}

``version.json`` is written by ``disagg repository --spec`` from the spec's ``model.versions``. Its
``checkpoint`` becomes the instance's ``model_dir``; its ``probe`` (a prompt, a greedy generation of
``max_tokens`` and the text it must decode to) is run by the instance on its own engine before it
serves. A version whose weights are missing fails to load; one that loads but does not reproduce its
probe text fails its load as well, so a rollout to it stops with the old version still serving.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg.config import build
from disagg.engine.backend import EngineBackend
from disagg.engine.errors import CheckpointError
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request

VERSION_FILE = "version.json"


@dataclass(frozen=True)
class Probe:
    """A readiness probe: greedy generation of ``max_tokens`` from ``prompt`` must decode to
    ``expect``."""

    prompt: str
    expect: str
    max_tokens: int = 8

    def __post_init__(self) -> None:
        """Its range; the types are ``config.build``'s (version.json's manifest, the spec's versions)."""
        if not 1 <= self.max_tokens <= 256:
            raise ValueError("max_tokens: must be in 1..256")


@dataclass(frozen=True)
class Manifest:
    checkpoint: str = ""  # "": the server's model
    probe: Probe | None = None


def read_manifest(model_folder: str | Path, version: int | str) -> Manifest:
    """The manifest of ``model_folder/<version>``; an empty one where the folder has none.
    CheckpointError when it is there but not valid."""
    number = int(version)
    path = Path(model_folder) / str(number) / VERSION_FILE
    if not path.is_file():
        return Manifest()
    try:
        return build(Manifest, json.loads(path.read_text()))
    except (OSError, ValueError) as exc:  # ConfigError is a ValueError
        raise CheckpointError(f"version {number}: {VERSION_FILE} is not valid ({exc})") from None


def run_probe(engine: EngineBackend, tokenizer: Any, probe: Probe, version: int) -> None:
    """Generate the probe greedily on ``engine``; CheckpointError when its text is not the expected."""
    from disagg.pool.offline import generate

    ids = tokenizer.encode(probe.prompt)
    tokens, _ = generate(engine, Request(tuple(ids), SamplingParams(max_tokens=probe.max_tokens)))
    text = tokenizer.decode(tokens)
    if text != probe.expect:
        raise CheckpointError(
            f"version {version} failed its readiness probe: {probe.max_tokens} greedy tokens gave "
            f"{text!r}, expected {probe.expect!r}"
        )
