"""The real default model served end to end, and `make serve` on a user's checkpoint.

- SmolLM2-135M-Instruct on the project's repository answers the chat-templated "What is the capital of
  France?" with Paris through `ensemble` (HTTP), `llm` (gRPC streaming) and `ensemble_colocated`.
- A repository whose prefill pool computes in fp32 and hands bf16 KV to a bf16 decode pool
  (`--prefill-dtype float32 --decode-dtype bfloat16`) loads so and serves across them (on the tiny
  model; the real model's answer across such a hand-off is tests/unit/engine/test_smollm2.py's).
- The default deployment's prefix cache serves a repeated 600-token prefix in under half the time.
- The OpenAI front end renders SmolLM2's own chat template (the prompt above, to the token) and the
  official `openai` client gets Paris from `/v1/chat/completions`.
- `MODEL_DIR=<a checkpoint of the user's> make serve` serves that checkpoint, leaves every byte of the
  folder as it was, and answers what `disagg generate --model <folder>` answers in the pools' dtype,
  through `ensemble` and through the OpenAI front end it starts beside Triton.
  A folder that is not a complete checkpoint is refused before anything starts.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from serving_support import REPOSITORY, engine_greedy, generate, grpc_stream, text_inputs
from triton_support import (
    REPO_ROOT,
    GrpcStream,
    LeakProbe,
    TritonFactory,
    descendants,
    free_ports,
    http_json,
    listening_addresses,
    live_children,
    metric_sum,
    scrape_metrics,
    timed_stream,
    wait_until,
)

from disagg.engine.tokenizer import Tokenizer
from disagg.openai.launcher import FrontendLaunch, FrontendProcess
from disagg.server import TritonServer
from disagg.serverconfig import STATE_DIR, load_or_create_admin_key
from disagg_tools import tiny_model
from disagg_tools.repository import Layout
from disagg_tools.repository import write as write_repository

pytestmark = pytest.mark.slow

QUESTION = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
DISAGG = Path(sys.executable).parent / "disagg"
GENERATE = ("--max-tokens", "12", "--dtype", "bfloat16", "--json")  # the pools' dtype


@pytest.fixture(scope="module")
def server(triton_factory: TritonFactory, smollm2_dir: Path) -> TritonServer:
    return triton_factory.start(REPOSITORY, exit_timeout_s=10, ready_timeout_s=240, model_dir=smollm2_dir)


@pytest.fixture
def own_regions_ignored(leak_probe: LeakProbe, server: TritonServer) -> None:
    leak_probe.ignore_shm(server.config.shm_prefix)


@pytest.mark.parametrize("model", ["ensemble", "ensemble_colocated"])
@pytest.mark.usefixtures("own_regions_ignored")
def test_http_generate_names_paris(server: TritonServer, model: str) -> None:
    body = {"text_input": QUESTION, "max_tokens": 32, "exclude_input_in_output": True}
    status, reply = generate(server, model, body)
    assert status == 200, reply
    assert "Paris" in reply["text_output"], reply
    assert "<|im_end|>" not in reply["text_output"]  # stopped at the end token, not printed


EMPTY_ANSWER = "Tell me about the harbour at dawn."
"""A prompt SmolLM2 answers with its end token first (in fp32 and in bf16): an empty answer."""


@pytest.mark.parametrize("model", ["ensemble", "llm", "ensemble_colocated"])
@pytest.mark.usefixtures("own_regions_ignored")
def test_an_answer_that_is_the_end_token_alone_comes_back_empty(
    server: TritonServer, smollm2_dir: Path, model: str
) -> None:
    """RELIABILITY A7: the model's end token first. Unary `generate` gets its one response, with an
    empty text and finish reason "stop" (it failed with "generate expects model to produce exactly 1
    response" when the final response carried flags alone)."""
    oracle = engine_greedy([EMPTY_ANSWER], 8, model_dir=smollm2_dir)[EMPTY_ANSWER]
    assert (oracle.text, oracle.finish_reason, len(oracle.token_ids)) == ("", "stop", 1), oracle
    body = {"text_input": EMPTY_ANSWER, "max_tokens": 8, "exclude_input_in_output": True}
    if model == "llm":  # the ensembles carry the TensorRT-LLM tensors, without finish_reason
        body["return_finish_reason"] = True
    status, reply = generate(server, model, body)
    assert status == 200, reply
    assert reply["text_output"] == "" and reply.get("finish_reason", "stop") == "stop", reply


@pytest.mark.usefixtures("own_regions_ignored")
def test_llm_grpc_stream_names_paris(server: TritonServer) -> None:
    result = grpc_stream(server, "llm", text_inputs(QUESTION, 32, stream=True))
    assert result.error is None and result.final, result
    assert len(result.pieces) > 3 and "Paris" in "".join(result.pieces), result.pieces


@pytest.mark.usefixtures("own_regions_ignored")
def test_a_repeated_prompt_prefix_is_served_from_the_prefix_cache(
    server: TritonServer, smollm2_dir: Path
) -> None:
    """The default deployment caches prompt prefixes (spec `kv.prefix_cache`): a 600-token document
    sent once, then again with another question after it, is not prefilled again. For each of three
    documents (new to this server), the second request's first token comes in at most half the time
    of the first's (median over the three), and the prefill pool counts the cached blocks as hits."""
    tokenizer = Tokenizer(smollm2_dir)
    salt = secrets.token_hex(4)
    hits = _prefill_hits(server)
    ttfts: dict[str, list[float]] = {"cold": [], "warm": []}
    for doc in range(3):
        words = [f"{salt}{doc}", *(f"line {i} of the harbour log reads calm water" for i in range(200))]
        document = " ".join(words)
        while len(tokenizer.encode(document)) > 600:
            document = document.rsplit(" ", 1)[0]
        assert len(tokenizer.encode(document)) >= 590
        for kind, question in (("cold", "What is the first line?"), ("warm", "What is the last line?")):
            with GrpcStream(server.config.grpc_url) as stream:
                values = text_inputs(
                    f"{document}\n{question}",
                    4,
                    stream=np.array([[True]]),
                    min_length=np.array([[4]], np.int32),
                )
                result = timed_stream(stream, "ensemble", values, timeout_s=120)
            assert result.error is None and result.ttft is not None, result
            ttfts[kind].append(result.ttft)
    cold, warm = statistics.median(ttfts["cold"]), statistics.median(ttfts["warm"])
    assert warm <= 0.5 * cold, ttfts
    # each warm request found the document's full 16-token blocks: about 37 of them each
    wait_until(lambda: _prefill_hits(server) - hits >= 3 * 30, 10, "the prefill pool's prefix cache hits")


def _prefill_hits(server: TritonServer) -> float:
    samples = scrape_metrics(server.config.metrics_url)
    return metric_sum(samples, "disagg_prefix_cache_hits_total", pool="prefill")


@pytest.mark.usefixtures("leak_probe")
def test_an_fp32_prefill_pool_hands_bf16_kv_to_a_bf16_decode_pool(
    triton_factory: TritonFactory, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The repository variant's pools as Triton loads them: fp32 prefill, bf16 KV, bf16 decode, and a
    stream served whole across them. That such a hand-off still answers right on the real model is
    tests/unit/engine/test_smollm2.py's (engine to engine, without three SmolLM2 pools to load)."""
    repository = tmp_path / "repository"
    write_repository(repository, Layout(prefill_dtype="float32", decode_dtype="bfloat16"))
    server = triton_factory.start(repository, exit_timeout_s=10, model_dir=tiny_model_dir)
    triton_factory.release(server)  # stopped here, so that the leak probe sees everything gone
    try:
        samples = scrape_metrics(server.config.metrics_url)
        infos = {dict(k)["model"]: dict(k) for name, k in samples if name == "disagg_engine_info"}
        assert (infos["prefill"]["dtype"], infos["prefill"]["kv_dtype"]) == ("float32", "bfloat16"), infos
        assert (infos["decode"]["dtype"], infos["decode"]["kv_dtype"]) == ("bfloat16", "bfloat16"), infos
        min_length = np.array([[16]], dtype=np.int32)
        result = grpc_stream(
            server, "llm", text_inputs("Hello world", 16, stream=True, min_length=min_length)
        )
        assert result.error is None and result.final and result.pieces, result
    finally:
        assert server.stop() == 0, server.log_tail()


@pytest.mark.usefixtures("own_regions_ignored")
def test_openai_chat_renders_the_models_template_and_names_paris(
    server: TritonServer, smollm2_dir: Path
) -> None:
    port = free_ports(1)[0]
    process = FrontendProcess(FrontendLaunch("127.0.0.1", port, server.config.grpc_url, smollm2_dir)).start()
    try:
        wait_until(lambda: _call(f"http://127.0.0.1:{port}/health") == (200, {"status": "ok"}), 60, "healthy")
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as client:
            reply = client.chat.completions.create(
                model=smollm2_dir.resolve().name,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=32,
                temperature=0,
            )
    finally:
        assert process.stop() == 0
    answer = reply.choices[0].message.content
    assert "Paris" in answer and "<|im_end|>" not in answer, answer
    assert reply.choices[0].finish_reason == "stop", "ended by the end token, within max_tokens"
    assert reply.usage.prompt_tokens == len(Tokenizer(smollm2_dir).encode(QUESTION))


def _call(
    url: str, body: dict | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any] | None:
    """(status, reply) of a GET (or a POST of `body`), None while nothing answers."""
    try:
        return http_json(url, body, headers=headers, timeout_s=60)
    except OSError:
        return None


# ---- make serve on a user's checkpoint ----------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file under `folder`: its bytes, mode and modification time (ns)."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mode, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def foreign_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's checkpoint: a complete Llama folder (weights unlike the tiny model's) that no builder of
    this project stamped, with a file of the user's own beside it, read-only to everyone."""
    folder = tiny_model.build(tmp_path_factory.mktemp("user") / "my-model", seed=7)
    (folder / tiny_model.STAMP_FILE).unlink()
    (folder / "NOTES.md").write_text("my fine-tune\n")
    return folder


def make_serve(model_dir: Path, ports: list[int], **extra: str) -> subprocess.Popen[str]:
    """`make serve` as a newcomer runs it (no address given), on free ports; `extra`: more environment."""
    env = {
        **os.environ,
        "MODEL_DIR": str(model_dir),
        "HTTP_PORT": str(ports[0]),
        "GRPC_PORT": str(ports[1]),
        "METRICS_PORT": str(ports[2]),
        "OPENAI_PORT": str(ports[3]),
        "SERVE_ARGS": "--exit-timeout 5",
        **extra,
    }
    env.pop("HOST", None)
    return subprocess.Popen(
        ["make", "--no-print-directory", "serve"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def serving_children(make_pid: int) -> list[int]:
    """`disagg serve` processes started by make (pid `make_pid`)."""
    pids = []
    for pid in live_children(make_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"disagg") for a in argv) and b"serve" in argv:
            pids.append(pid)
    return pids


def test_make_serve_on_a_user_checkpoint_serves_it_and_changes_no_byte(
    foreign_checkpoint: Path, tmp_path: Path
) -> None:
    before = snapshot(foreign_checkpoint)
    proc = subprocess.run(
        [str(DISAGG), "generate", "--model", str(foreign_checkpoint), "--prompt", "Hello world", *GENERATE],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    expected = json.loads(proc.stdout.strip().splitlines()[-1])["text"]
    ports = free_ports(4)
    # the deployment secret (signing KV hand-offs and pool tokens) is made afresh under this state folder
    state = tmp_path / "state"
    serve = make_serve(foreign_checkpoint, ports, DISAGG_API_KEY=API_KEY, XDG_STATE_HOME=str(state))
    try:
        url = f"http://127.0.0.1:{ports[0]}/v2/models/ensemble/generate"
        body = {"text_input": "Hello world", "max_tokens": 12, "exclude_input_in_output": True}

        def answer() -> dict | None:
            if serve.poll() is not None:
                raise AssertionError(f"make serve exited {serve.returncode}: {serve.stdout.read()[-3000:]}")
            try:
                status, reply = http_json(url, body, timeout_s=60)
            except OSError:
                return None
            return reply if status == 200 else None

        reply = wait_until(answer, 240, "make serve answering")
        assert reply["text_output"] == expected
        # the OpenAI front end `disagg serve` started beside Triton, on OPENAI_PORT
        completion = {"model": "my-model", "prompt": "Hello world", "max_tokens": 12, "temperature": 0}
        url = f"http://127.0.0.1:{ports[3]}/v1/completions"
        status, reply = wait_until(lambda: _call(url, completion), 30, "the OpenAI front end answering")
        assert status == 401 and reply["error"]["code"] == "invalid_api_key", reply  # DISAGG_API_KEY set
        keyed = {"Authorization": f"Bearer {API_KEY}"}
        status, reply = _call(url, completion, headers=keyed)
        assert status == 200 and reply["choices"][0]["text"] == expected, reply
        # a newcomer's server listens on loopback only, and shows no secret to other local users
        processes = descendants(serve.pid)
        listening = listening_addresses(processes)
        assert all(is_loopback(address.rsplit(":", 1)[0]) for address in listening), listening
        assert {str(p) for p in ports} <= {a.rsplit(":", 1)[1] for a in listening}, listening
        secret = deployment_secret(state)
        assert_no_secret_shown(processes, load_or_create_admin_key(REPO_ROOT / STATE_DIR), secret)
    finally:
        # SIGTERM to `disagg serve` (make's child), as Ctrl-C or a process manager would send it;
        # make then exits with its status.
        for pid in serving_children(serve.pid):
            os.kill(pid, signal.SIGTERM)
        output, _ = serve.communicate(timeout=90)
    assert serve.returncode == 0, output[-3000:]
    admin_key = load_or_create_admin_key(REPO_ROOT / STATE_DIR)
    assert API_KEY not in output and admin_key not in output and secret not in output  # nor in its log
    assert snapshot(foreign_checkpoint) == before
    assert sorted(p.name for p in foreign_checkpoint.parent.iterdir()) == ["my-model"]


API_KEY = "sk-newcomer-" + "7" * 24


def is_loopback(host: str) -> bool:
    """127.0.0.0/8 or ::1, or an IPv6 socket's IPv4-mapped form of one (::ffff:127.0.0.1)."""
    address = ipaddress.ip_address(host)
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def deployment_secret(state: Path) -> str:
    """The deployment secret the pools made under ``state`` (``$XDG_STATE_HOME``), owner-only."""
    path = state / "triton-disagg" / "secret"
    assert path.stat().st_mode & 0o077 == 0, oct(path.stat().st_mode)
    secret = path.read_text().strip()
    assert len(secret) >= 32, "not a secret"
    return secret


def assert_no_secret_shown(processes: frozenset[int], admin_key: str, secret: str) -> None:
    """No command line (world-readable) holds the admin key, the deployment secret or the API key;
    no environment holds the admin key or the deployment secret, and only the front end's and its
    parent's hold the API key (the front end needs it)."""
    names = {}
    for pid in processes:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # exited meanwhile
        names[pid] = cmdline.split(b"\0")[:3]
        shown = cmdline.decode(errors="replace")
        for key in (admin_key, secret, API_KEY):
            assert key not in shown, f"pid {pid} shows a key: {names[pid]}"
        for key in (admin_key, secret):
            assert key.encode() not in environ, f"pid {pid} has a secret in its environment"
        is_frontend = b"disagg.openai" in cmdline
        is_serve = b"serve" in cmdline and b"tritonserver" not in cmdline
        if not (is_frontend or is_serve):
            assert API_KEY.encode() not in environ, f"pid {pid} has the API key: {names[pid]}"
    tritons = [pid for pid, argv in names.items() if argv and argv[0].endswith(b"tritonserver")]
    assert tritons, f"no tritonserver among {names}"


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("tokenizer.json", "has no tokenizer.json"),
        ("model.safetensors", "has no *.safetensors file"),
        ("config.json", "has no config.json"),
    ],
)
def test_make_serve_refuses_an_incomplete_checkpoint_and_changes_nothing(
    foreign_checkpoint: Path, tmp_path: Path, missing: str, message: str
) -> None:
    folder = tmp_path / "half"
    folder.mkdir()
    for path in foreign_checkpoint.iterdir():
        if path.name != missing:
            (folder / path.name).write_bytes(path.read_bytes())
    before = snapshot(folder)
    serve = make_serve(folder, free_ports(4))
    output, _ = serve.communicate(timeout=120)
    assert serve.returncode != 0
    assert message in output, output[-2000:]
    assert "Triton" not in output and "tritonserver" not in output  # refused before anything started
    assert snapshot(folder) == before
