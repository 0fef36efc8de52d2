"""Helpers for the serving tests on the project's model repository: the engine oracle, text requests
over HTTP and gRPC, the pool gauges of `/metrics`, and the server's stub processes.

Plain functions (no fixtures); import them as `from serving_support import ...`.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from triton_support import REPO_ROOT, GrpcStream, http_json, http_sse, wait_until

from disagg.paths import resolve_model_dir
from disagg.server import process_group_members

REPOSITORY = REPO_ROOT / "model_repository"

# The start of a client script run with `python -c` (a cancelled tritonclient stream leaves a thread
# behind, which the leak probe would count, so cancelling clients run in processes of their own):
# its imports, and `long_request(max_tokens, seed=0)`, the inputs of a "Hello world" streaming request
# that generates exactly `max_tokens` tokens (with sampling seed `seed`, which names an injected fault:
# disagg.pool.faults). The script's own part follows it.
CLIENT_SCRIPT_PREAMBLE = """
import json, queue, sys
import numpy as np
import tritonclient.grpc as grpcclient
def tensor(name, value, dtype):
    array = np.array([[value]], dtype=dtype)
    kind = {np.object_: "BYTES", np.int32: "INT32", np.uint64: "UINT64", bool: "BOOL"}[dtype]
    t = grpcclient.InferInput(name, list(array.shape), kind)
    t.set_data_from_numpy(array)
    return t
def long_request(max_tokens, seed=0):
    return [tensor("text_input", b"Hello world", np.object_), tensor("max_tokens", max_tokens, np.int32),
            tensor("min_length", max_tokens, np.int32), tensor("stream", True, bool)] + (
            [tensor("random_seed", seed, np.uint64)] if seed else [])
"""
ENTRY_POINTS = ("ensemble", "llm", "ensemble_colocated")
POOLS = ("prefill", "decode", "colocated")
POOL_GAUGES = ("disagg_kv_blocks_used", "disagg_kv_blocks_free", "disagg_decode_active_sequences")


@dataclass(frozen=True)
class Greedy:
    """One prompt's greedy output from the reference engine.

    `first_piece` is the text streamed with the first token (the one prefill samples); `margin` is
    the smallest gap between the two largest logits over every step (float32), or None with
    `min_length`, whose masking of the stop tokens it does not follow; `finish_reason` is the engine's
    ("stop": an end token, counted in `token_ids`; "length": `max_tokens`)."""

    token_ids: tuple[int, ...]
    text: str
    first_piece: str
    margin: float | None
    finish_reason: str | None = None


def engine_greedy(
    prompts: Iterable[str],
    max_tokens: int,
    dtype: str = "auto",
    min_length: int = 0,
    model_dir: Path | None = None,
) -> dict[str, Greedy]:
    """Greedy output of each prompt from the reference engine, one prompt at a time (batch size 1),
    as `disagg generate --dtype <dtype>` prints it: the oracle the entry points are compared with
    (``auto``, the default repository's dtype, resolves by the same rule as its pools)."""
    from disagg.engine.engine import Engine, EngineConfig
    from disagg.engine.params import SamplingParams
    from disagg.engine.sequence import Request
    from disagg.engine.tokenizer import Tokenizer
    from disagg.pool.offline import generate
    from disagg.serving.detokenizer import IncrementalDetokenizer

    class MarginEngine(Engine):
        margin = math.inf

        def _append(self, seq: Any, logits: Any) -> Any:
            top = logits.float().topk(2).values
            self.margin = min(self.margin, float(top[0] - top[1]))
            return super()._append(seq, logits)

    model_dir = model_dir or resolve_model_dir()
    tokenizer = Tokenizer(model_dir)
    engine = MarginEngine(EngineConfig(model_dir=model_dir, dtype=dtype, kv_cache_mb=64))
    params = SamplingParams(max_tokens=max_tokens, min_length=min_length)
    results = {}
    for prompt in prompts:
        engine.margin = math.inf
        token_ids, reason = generate(engine, Request(tuple(tokenizer.encode(prompt)), params))
        results[prompt] = Greedy(
            token_ids=tuple(token_ids),
            text=tokenizer.decode(token_ids),
            first_piece=IncrementalDetokenizer(tokenizer.decode).add(token_ids[0]),
            margin=None if min_length else engine.margin,
            finish_reason=reason,
        )
    return results


def engine_texts(
    prompts: Iterable[str], max_tokens: int, dtype: str = "auto", model_dir: Path | None = None
) -> dict[str, str]:
    """Greedy text of each prompt from the reference engine (`engine_greedy`), on ``model_dir``
    (default: the suite's model)."""
    greedy = engine_greedy(prompts, max_tokens, dtype, model_dir=model_dir)
    return {prompt: g.text for prompt, g in greedy.items()}


# ---- requests --------------------------------------------------------------------------------------


def text_inputs(prompt: str | bytes, max_tokens: int, **extra: Any) -> dict[str, np.ndarray]:
    """The ensemble tensors of one request as numpy arrays of shape [1, 1] (batch 1, dims [1])."""
    raw = prompt.encode() if isinstance(prompt, str) else prompt
    values = {
        "text_input": np.array([[raw]], dtype=np.object_),
        "max_tokens": np.array([[max_tokens]], dtype=np.int32),
    }
    for name, value in extra.items():
        values[name] = value if isinstance(value, np.ndarray) else np.array([[value]])
    return values


NO_ADMISSION = {
    model: {"admission.margin": "0"} for model in ("orchestrator", "orchestrator_colocated", "llm")
}
"""Entry points that admit every request: for tests that load the pools past the default admission
bound on purpose, to exercise something else (the suite's tiny model prefills its warm-up too fast to
measure, so admission also holds its backlog to the cold budget until real work has been timed)."""


def repository_with_parameters(target: Path, parameters: Mapping[str, Mapping[str, str]]) -> Path:
    """A copy of the project's repository under `target` whose models carry `parameters` (see
    `set_parameters`)."""
    copy = target / "repository"
    shutil.copytree(REPOSITORY, copy)
    set_parameters(copy, parameters)
    return copy


def set_parameters(repository: Path, parameters: Mapping[str, Mapping[str, str]]) -> None:
    """Give the models of `repository` `parameters` (model -> key -> value), each replacing the key's
    entry, if it had one."""
    for model, values in parameters.items():
        config = repository / model / "config.pbtxt"
        text = config.read_text()
        for key in values:
            text = re.sub(rf'  \{{ key: "{re.escape(key)}"[^\n]*\n', "", text)
        entries = "".join(
            f'  {{ key: "{k}", value: {{ string_value: "{v}" }} }},\n' for k, v in values.items()
        )
        text = text.replace("parameters [\n", "parameters [\n" + entries, 1)
        config.write_text(re.sub(r",\n\]", "\n]", text))  # the last entry has no comma


def repository_with_llm_parameters(target: Path, parameters: Mapping[str, str]) -> Path:
    """A copy of the project's repository under `target` whose `llm` entry point has `parameters`."""
    return repository_with_parameters(target, {"llm": parameters})


def prompt_burst(server: Any, count: int, words: int) -> list[GrpcStream]:
    """After one short `llm` request (it starts the entry point's watcher), `count` streams each
    sending `llm` a prompt of `words` unique words, 4 tokens out; the caller closes the streams."""
    with GrpcStream(server.config.grpc_url) as first:
        first.send("llm", text_inputs("Hello world", 4, stream=True))
        assert read_stream(first, 60).final
    streams = [GrpcStream(server.config.grpc_url) for _ in range(count)]
    for i, stream in enumerate(streams):
        stream.send("llm", text_inputs(" ".join(f"w{i}x{j}" for j in range(words)), 4, stream=True))
    return streams


def generate(server: Any, model: str, body: Mapping[str, Any]) -> tuple[int, Any]:
    """HTTP `generate` (unary): (status, parsed body)."""
    return http_json(f"http://{server.config.http_url}/v2/models/{model}/generate", body, timeout_s=120)


def generate_stream(server: Any, model: str, body: Mapping[str, Any]) -> list[Any]:
    """HTTP `generate_stream` (SSE): the parsed events."""
    url = f"http://{server.config.http_url}/v2/models/{model}/generate_stream"
    return http_sse(url, {**body, "stream": True}, timeout_s=120)


@dataclass(frozen=True)
class StreamResult:
    pieces: list[str]
    error: str | None
    final: bool


def read_stream(stream: GrpcStream, timeout_s: float = 120.0) -> StreamResult:
    """Drain one request of `stream` to its final response or error."""
    pieces: list[str] = []
    for event in stream.until_final(timeout_s):
        if event.error is not None:
            return StreamResult(pieces, str(event.error), False)
        output = event.result.as_numpy("text_output")
        if output is not None:
            pieces.append(output.reshape(-1)[0].decode("utf-8"))
        if event.final:
            return StreamResult(pieces, None, True)
    raise AssertionError("stream ended without a final response")  # until_final always ends on one


def grpc_stream(
    server: Any, model: str, values: Mapping[str, np.ndarray], timeout_s: float = 120
) -> StreamResult:
    """One request over its own gRPC stream, read to the end."""
    with GrpcStream(server.config.grpc_url) as stream:
        stream.send(model, values)
        return read_stream(stream, timeout_s)


def grpc_error(server: Any, model: str, values: Mapping[str, np.ndarray]) -> str:
    """The error text of a request that must fail (gRPC streaming carries no status code, only text)."""
    result = grpc_stream(server, model, values, timeout_s=60)
    assert result.error is not None, f"{model} accepted the request: {result}"
    return result.error


_CANCELLING_CLIENT = (
    CLIENT_SCRIPT_PREAMBLE
    + """
url, model, max_tokens, after = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
events = queue.Queue()
client = grpcclient.InferenceServerClient(url)
client.start_stream(callback=lambda result, error: events.put(error))
client.async_stream_infer(model, long_request(max_tokens))
errors = [events.get(timeout=60) for _ in range(after)]
client.stop_stream(cancel_requests=True)
client.close()
print(json.dumps({"pieces": after, "errors": [str(e) for e in errors if e is not None]}))
"""
)


def cancel_after(url: str, model: str, max_tokens: int, pieces: int) -> dict[str, Any]:
    """Stream from ``url`` (gRPC) in a separate process and cancel after `pieces` pieces. A separate
    process, because tritonclient keeps a thread alive after a cancelled stream, which the leak probe
    would count."""
    return _client_in_child(_CANCELLING_CLIENT, url, model, str(max_tokens), str(pieces))


def _client_in_child(script: str, *args: str, timeout_s: float = 180) -> dict[str, Any]:
    """Run a client script in a child interpreter; the JSON of its last line."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_DEADLINE_CLIENT = (
    CLIENT_SCRIPT_PREAMBLE
    + """
url, model, max_tokens, deadline_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
events = queue.Queue()
client = grpcclient.InferenceServerClient(url)
client.start_stream(callback=lambda result, error: events.put(error), stream_timeout=deadline_s)
client.async_stream_infer(model, long_request(max_tokens))
pieces, error = 0, None
while error is None:
    error = events.get(timeout=120)
    pieces += error is None
client.stop_stream()
client.close()
print(json.dumps({"pieces": pieces, "error": str(error)}))
"""
)


_CUED_CLIENT = (
    CLIENT_SCRIPT_PREAMBLE
    + """
url, model, prompt = sys.argv[1], sys.argv[2], sys.argv[5]
max_tokens, seed = int(sys.argv[3]), int(sys.argv[4])
errors = []
def on_response(result, error):
    if error is not None and "Locally cancelled" not in str(error):  # the cancel itself
        errors.append(str(error))
    print("piece" if error is None else "error", flush=True)
client = grpcclient.InferenceServerClient(url)
client.start_stream(callback=on_response)
request = long_request(max_tokens, seed)
request[0] = tensor("text_input", prompt.encode(), np.object_)
client.async_stream_infer(model, request)
print("sent", flush=True)
sys.stdin.readline()
client.stop_stream(cancel_requests=True)
client.close()
print(json.dumps({"errors": errors}), flush=True)
"""
)


class CuedCancel:
    """A streamed request (``long_request(max_tokens, seed)`` with ``prompt``) from a client process of
    its own (see ``cancel_after``) that cancels it when told: ``pieces(n)`` waits for its first ``n``
    responses, ``cancel()`` cancels and returns the client's errors. A context manager: the client is
    killed on exit if it has not ended."""

    def __init__(self, url: str, model: str, max_tokens: int, seed: int, prompt: str = "Hello world") -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CUED_CLIENT, url, model, str(max_tokens), str(seed), prompt],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._line("sent")

    def _line(self, want: str) -> None:
        line = self._proc.stdout.readline().strip()  # type: ignore[union-attr]
        if line != want:
            self._proc.kill()
            _, err = self._proc.communicate(timeout=30)
            raise AssertionError(f"client said {line!r}, not {want!r}: {err[-2000:]}")

    def pieces(self, count: int) -> None:
        for _ in range(count):
            self._line("piece")

    def cancel(self) -> list[str]:
        out, err = self._proc.communicate("\n", timeout=60)
        assert self._proc.returncode == 0, err[-2000:]
        return json.loads(out.strip().splitlines()[-1])["errors"]

    def __enter__(self) -> CuedCancel:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.communicate(timeout=30)


def stream_with_deadline(url: str, model: str, max_tokens: int, deadline_s: float) -> dict[str, Any]:
    """Stream from ``url`` (gRPC, in a separate process: see ``cancel_after``) with a client deadline
    of `deadline_s` on the stream: the pieces that came and the error that ended it."""
    return _client_in_child(_DEADLINE_CLIENT, url, model, str(max_tokens), str(deadline_s))


# ---- metrics ---------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$", re.M)


def metric_samples(server: Any) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(server.config.metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = []
    for name, labels, value in _SAMPLE.findall(text):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        samples.append((name, pairs, float(value)))
    return samples


def pool_gauges(server: Any) -> dict[tuple[str, str], float]:
    """(family, pool) -> value summed over the pool's instances, for the families in `POOL_GAUGES`."""
    gauges: dict[tuple[str, str], float] = {}
    for name, labels, value in metric_samples(server):
        if name in POOL_GAUGES and "pool" in labels:
            key = (name, labels["pool"])
            gauges[key] = gauges.get(key, 0.0) + value
    return gauges


def idle_gauges(server: Any) -> dict[tuple[str, str], float]:
    """The pool gauges once nothing runs: no active sequence and no block in use on any pool (waits
    up to 30 s for it)."""

    def quiet() -> dict[tuple[str, str], float] | None:
        gauges = pool_gauges(server)
        busy = [k for k, v in gauges.items() if k[0] != "disagg_kv_blocks_free" and v]
        return None if busy else gauges

    return wait_until(quiet, 30, "pools idle")


def metric_sum(server: Any, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(
        value
        for sample, have, value in metric_samples(server)
        if sample == name and all(have.get(k) == v for k, v in labels.items())
    )


# ---- processes -------------------------------------------------------------------------------------


def group_rss(pgid: int) -> dict[str, int]:
    """Resident memory (bytes) of every live process of a process group (the server and its stubs),
    keyed by the stub's instance name (`<model>_<group>_<index>`) or the command's name."""
    sizes: dict[str, int] = {}
    for pid in process_group_members(pgid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        names = [a.decode() for a in argv[1:] if re.fullmatch(rb"\w+_\d+_\d+", a)]
        key = names[0] if names else Path(argv[0].decode(errors="replace")).name or str(pid)
        sizes[key] = sizes.get(key, 0) + (int(match.group(1)) * 1024 if match else 0)
    return sizes
