"""The EngineBackend protocol, one suite for every backend.

``torch``: the reference Engine on the tiny model, its KV blocks in a fake KV transport's pool.
``trtllm``: TrtllmBackend over the fake ``tensorrt_llm`` module (``fake_trtllm``), whose tokens come
from the same reference engine. The TensorRT-LLM adapter has never run against TensorRT-LLM: passing
here shows it keeps the protocol against the documented API as the fake models it, nothing more.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fake_trtllm
import pytest

from disagg.config import ConfigError
from disagg.engine.backend import BlockUsage, EngineBackend
from disagg.engine.engine import Engine, EngineConfig, plan_kv
from disagg.engine.errors import BatchFull, InvalidRequest, OutOfBlocks, SequenceFailed, UnknownSequence
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import FINISH_LENGTH, FINISH_STOP, Request
from disagg.engine.trtllm import TrtllmBackend, TrtllmConfig
from disagg.kv import DescriptorError, LeaseExpired, TransferError, TransportConfig, create_transport

SECRET = b"backend-conformance-" + b"s" * 16
KINDS = ["torch", "trtllm"]
GREEDY = SamplingParams(max_tokens=12, min_length=12)  # min_length: no early stop, exactly 12 tokens
SAMPLED = SamplingParams(max_tokens=12, min_length=12, temperature=0.9, top_k=40, seed=77)
PROMPT = (1, 7, 9, 11, 13, 17)
DEADLINE_S = 60.0

Factory = Callable[..., Any]


@pytest.fixture
def transport() -> Iterator[Any]:
    t = create_transport("fake", TransportConfig(secret=SECRET, prefix="bconf"))
    yield t
    t.close()


def _trtllm_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("trtllm-seq-", "fake-trtllm"))]


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("trtllm-seq-")]


def _poll(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.005)


@pytest.fixture
def trtllm_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    module = fake_trtllm.install(monkeypatch)
    yield module
    _poll(lambda: not _trtllm_threads(), "TensorRT-LLM reader / executor threads to end")
    assert fake_trtllm.held_kv() == 0, "context KV left in the fake cache transceiver"


def _make_torch(model: Path, transport: Any, max_batch_size: int, num_blocks: int) -> Engine:
    config = EngineConfig(model_dir=model, block_size=4, num_blocks=num_blocks, max_batch_size=max_batch_size)
    layout, n = plan_kv(config)
    return Engine(config, kv_memory=transport.allocate_memory(n, layout.block_bytes))


@pytest.fixture
def make_trtllm(trtllm_module: Any, tiny_model_dir: Path) -> Iterator[Factory]:
    made: list[TrtllmBackend] = []

    def factory(max_batch_size: int = 4, num_blocks: int = 64, **settings: Any) -> TrtllmBackend:
        clock = settings.pop("clock", None)
        config = TrtllmConfig(
            model=tiny_model_dir,
            tokens_per_block=4,
            num_blocks=num_blocks,
            max_batch_size=max_batch_size,
            request_timeout_s=30.0,
            **settings,
        )
        backend = TrtllmBackend(config, clock=clock)
        made.append(backend)
        return backend

    yield factory
    for backend in made:
        backend.close()


@pytest.fixture(params=KINDS)
def make(request: pytest.FixtureRequest, tiny_model_dir: Path, transport: Any) -> Factory:
    """make(max_batch_size=4, num_blocks=64) -> a fresh backend of the parametrized kind."""
    if request.param == "trtllm":
        return request.getfixturevalue("make_trtllm")

    def factory(max_batch_size: int = 4, num_blocks: int = 64) -> Engine:
        return _make_torch(tiny_model_dir, transport, max_batch_size, num_blocks)

    return factory


# ---------------------------------------------------------------------------- helpers


def check_usage(backend: EngineBackend) -> BlockUsage:
    usage = backend.usage()
    assert usage.used >= 0 and usage.free >= 0, usage
    assert usage.used + usage.free == backend.limits.num_blocks, usage
    return usage


def drain(backend: EngineBackend, streams: dict[int, list[int]]) -> dict[int, str]:
    """decode_step until every sequence of ``streams`` finished; tokens appended; reasons returned."""
    reasons: dict[int, str] = {}
    deadline = time.monotonic() + DEADLINE_S
    while len(reasons) < len(streams):
        assert time.monotonic() < deadline, "sequences did not finish"
        for out in backend.decode_step():
            assert out.seq_id in streams, "a token for a sequence nobody is decoding"
            assert out.seq_id not in reasons, "a token after the sequence finished"
            streams[out.seq_id].append(out.token_id)
            if out.finished:
                assert out.finish_reason in (FINISH_STOP, FINISH_LENGTH)
                reasons[out.seq_id] = out.finish_reason
        check_usage(backend)
    return reasons


def generate(backend: EngineBackend, request: Request) -> list[int]:
    (out,) = backend.prefill([request], decode=True)
    tokens = {out.seq_id: [out.token_id]}
    if not out.finished:
        drain(backend, tokens)
    return tokens[out.seq_id]


def handoff(exporter: EngineBackend, importer: EngineBackend, request: Request, transport: Any) -> Any:
    """Prefill on ``exporter`` and hand the sequence to ``importer``: (first output, exported, imported)."""
    (out,) = exporter.prefill([request], decode=False)
    assert not out.finished
    exported = exporter.export_sequence(out.seq_id, transport)
    imported = importer.import_sequence(exported.state, exported.descriptor, transport)
    return out, exported, imported


def tamper(descriptor: bytes) -> bytes:
    """The same envelope with one digit of its signed body changed (the MAC left as it was)."""
    outer = json.loads(descriptor)
    body = outer["b"]
    i = next(i for i, c in enumerate(body) if c.isdigit())
    outer["b"] = body[:i] + str((int(body[i]) + 1) % 10) + body[i + 1 :]
    return json.dumps(outer).encode()


# ---------------------------------------------------------------------------- conformance


def test_limits_are_sane(make: Factory) -> None:
    backend = make(max_batch_size=3, num_blocks=40)
    limits = backend.limits
    assert (limits.num_blocks, limits.block_size, limits.max_batch_size) == (40, 4, 3)
    assert limits.vocab_size == 1024 and limits.max_context == 2048  # the tiny model's config
    assert [limits.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    request = Request(PROMPT, GREEDY)
    assert limits.blocks_needed(request) == 5 and limits.blocks_needed(request, decode=False) == 2
    assert check_usage(backend) == BlockUsage(0, 40)


BAD = [
    Request(()),
    Request((1, 1024)),
    Request((1, -1)),
    Request((1, True)),  # type: ignore[arg-type]
    Request((1, 2), SamplingParams(max_tokens=0)),
    Request((1, 2), SamplingParams(max_tokens=2047)),  # 2 + 2047 > 2048
    Request((1, 2), SamplingParams(temperature=-1.0)),
    Request((1, 2), SamplingParams(top_p=0.0)),
    Request((1, 2), SamplingParams(top_k=-1)),
    Request((1, 2), SamplingParams(end_id=1024)),
    Request((1, 2), SamplingParams(stop_token_ids=(5000,))),
    Request((1, 2), SamplingParams(max_tokens=4, min_length=5)),
]


def test_validate_refuses_bad_input(make: Factory) -> None:
    backend = make()
    good = Request(PROMPT, GREEDY)
    assert backend.validate(good) is None
    for bad in BAD:
        with pytest.raises(InvalidRequest):
            backend.validate(bad)
        for decode in (True, False):
            with pytest.raises(InvalidRequest):
                backend.prefill([good, bad], decode=decode)  # all-or-nothing
    assert check_usage(backend) == BlockUsage(0, 64)
    assert backend.decode_step() == []


def test_prefill_then_decode_to_completion(make: Factory) -> None:
    backend = make()
    start = check_usage(backend)
    lengths = (1, 5, 9, 12)
    requests = [
        Request((1, 3 + i, 8, 20 + i), SamplingParams(max_tokens=n, min_length=n))
        for i, n in enumerate(lengths)
    ]
    outs = backend.prefill(requests, decode=True)
    assert [o.finished for o in outs] == [True, False, False, False]  # max_tokens=1 ends at prefill
    assert outs[0].finish_reason == FINISH_LENGTH
    assert len({o.seq_id for o in outs}) == 4
    needed = sum(backend.limits.blocks_needed(r) for r in requests[1:])
    assert check_usage(backend).used == needed
    streams = {o.seq_id: [o.token_id] for o in outs[1:]}
    reasons = drain(backend, streams)
    assert [len(streams[o.seq_id]) for o in outs[1:]] == list(lengths[1:])
    assert set(reasons.values()) == {FINISH_LENGTH}
    assert all(0 <= t < backend.limits.vocab_size for s in streams.values() for t in s)
    assert check_usage(backend) == start
    assert [backend.free(o.seq_id) for o in outs] == [False] * 4, "finished sequences are freed"
    assert backend.decode_step() == []


def test_started_sequences_prefill_in_chunks_as_one(make: Factory) -> None:
    """start + prefill_chunk gives the tokens of prefill(); an engine with chunked prefill takes the
    prompt in the chunks asked for (None until the last), one without takes it whole."""
    backend = make()
    prompt = tuple([1, *range(30, 51)])  # 22 tokens
    request = Request(prompt, SamplingParams(max_tokens=6, min_length=6))
    (whole,) = backend.prefill([request], decode=True)
    expected = {whole.seq_id: [whole.token_id]}
    drain(backend, expected)
    seq_id = backend.start(request, decode=True)
    assert check_usage(backend).used == backend.limits.blocks_needed(request)
    assert backend.decode_step() == [], "a started sequence is not in the batch yet"
    outputs = [backend.prefill_chunk(seq_id, 5)]
    while outputs[-1] is None:
        outputs.append(backend.prefill_chunk(seq_id, 5))
    assert len(outputs) == (5 if backend.limits.chunked_prefill else 1)  # 5 + 5 + 5 + 5 + 2
    streams = {seq_id: [outputs[-1].token_id]}
    drain(backend, streams)
    assert streams[seq_id] == expected[whole.seq_id]
    assert check_usage(backend) == BlockUsage(0, backend.limits.num_blocks)
    held = backend.start(request, decode=False)
    assert backend.free(held) and check_usage(backend).used == 0, "a started sequence can be freed"


def test_stop_token_ends_a_sequence(make: Factory) -> None:
    backend = make()
    tokens = generate(backend, Request(PROMPT, GREEDY))
    stop = tokens[3]
    cut = tokens.index(stop)
    (out,) = backend.prefill([Request(PROMPT, SamplingParams(max_tokens=12, end_id=stop))], decode=True)
    stream = {out.seq_id: [out.token_id]}
    reasons = {out.seq_id: out.finish_reason} if out.finished else drain(backend, stream)
    assert stream[out.seq_id] == tokens[: cut + 1]
    assert reasons[out.seq_id] == FINISH_STOP
    assert check_usage(backend).used == 0


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_handoff_continues_the_sequence_exactly(
    make: Factory, transport: Any, params: SamplingParams
) -> None:
    request = Request(PROMPT, params)
    expected = generate(make(), request)
    assert len(expected) == params.max_tokens
    exporter, importer = make(), make()
    out, exported, imported = handoff(exporter, importer, request, transport)
    assert exporter.decode_step() == [], "a prefill-only sequence never decodes"
    assert check_usage(exporter).used == exporter.limits.blocks_needed(request, decode=False)
    assert exported.state.prompt_token_ids == PROMPT
    assert exported.state.generated_token_ids == (out.token_id,)
    assert isinstance(exported.descriptor, bytes) and exported.lease_id
    assert imported.transfer_s >= 0
    assert check_usage(importer).used == importer.limits.blocks_needed(request)
    stream = {imported.seq_id: [out.token_id]}
    assert drain(importer, stream) == {imported.seq_id: FINISH_LENGTH}
    assert stream[imported.seq_id] == expected
    assert exporter.free(out.seq_id) is True
    assert check_usage(exporter).used == 0 and check_usage(importer).used == 0


def test_free_is_idempotent(make: Factory, transport: Any) -> None:
    backend = make()
    a, b = backend.prefill([Request(PROMPT, GREEDY), Request((1, 2, 3), GREEDY)], decode=True)
    (held,) = backend.prefill([Request((1, 4, 5), GREEDY)], decode=False)
    assert backend.free(a.seq_id) is True
    assert backend.free(a.seq_id) is False
    assert backend.free(held.seq_id) is True and backend.free(held.seq_id) is False
    assert backend.free(987654) is False
    with pytest.raises(UnknownSequence):
        backend.export_sequence(held.seq_id, transport)
    assert check_usage(backend).used == backend.limits.blocks_needed(Request((1, 2, 3), GREEDY))
    stream = {b.seq_id: [b.token_id]}
    drain(backend, stream)  # asserts no token arrives for the freed sequence
    assert len(stream[b.seq_id]) == GREEDY.max_tokens
    assert check_usage(backend) == BlockUsage(0, 64)


def test_tampered_descriptor_is_refused(make: Factory, transport: Any) -> None:
    request = Request(PROMPT, GREEDY)
    exporter, importer = make(), make()
    (out,) = exporter.prefill([request], decode=False)
    exported = exporter.export_sequence(out.seq_id, transport)
    other = create_transport(
        "fake", TransportConfig(secret=b"another-deployment-" + b"z" * 16, prefix="bconf")
    )
    try:
        forged = [
            (tamper(exported.descriptor), transport),
            (exported.descriptor[:-7], transport),
            (b"{}", transport),
            (exported.descriptor, other),  # signed with a secret this deployment does not have
        ]
        for descriptor, via in forged:
            with pytest.raises(DescriptorError):
                importer.import_sequence(exported.state, descriptor, via)
            assert check_usage(importer) == BlockUsage(0, 64)
            assert importer.decode_step() == []
    finally:
        other.close()
    imported = importer.import_sequence(exported.state, exported.descriptor, transport)  # still good
    stream = {imported.seq_id: [out.token_id]}
    drain(importer, stream)
    assert len(stream[imported.seq_id]) == GREEDY.max_tokens
    exporter.free(out.seq_id)


def test_replayed_descriptor_is_refused(make: Factory, transport: Any) -> None:
    request = Request(PROMPT, GREEDY)
    exporter, importer = make(), make()
    _, exported, imported = handoff(exporter, importer, request, transport)
    used = check_usage(importer)
    with pytest.raises(DescriptorError):
        importer.import_sequence(exported.state, exported.descriptor, transport)
    assert check_usage(importer) == used
    importer.free(imported.seq_id)


def test_batch_beyond_max_batch_size_is_refused(make: Factory, transport: Any) -> None:
    backend = make(max_batch_size=2)
    requests = [Request((1, 2 + i, 9), GREEDY) for i in range(3)]
    with pytest.raises(BatchFull):
        backend.prefill(requests, decode=True)
    assert check_usage(backend).used == 0 and backend.decode_step() == []
    outs = backend.prefill(requests[:2], decode=True)
    with pytest.raises(BatchFull):
        backend.prefill(requests[2:], decode=True)
    held = backend.prefill(requests, decode=False)  # held for export: no batch slot taken
    exporter = make()
    (first,) = exporter.prefill([Request(PROMPT, GREEDY)], decode=False)
    exported = exporter.export_sequence(first.seq_id, transport)
    with pytest.raises(BatchFull):
        backend.import_sequence(exported.state, exported.descriptor, transport)
    for h in held:
        backend.free(h.seq_id)
    drain(backend, {o.seq_id: [o.token_id] for o in outs})
    imported = backend.import_sequence(exported.state, exported.descriptor, transport)  # room now
    drain(backend, {imported.seq_id: [first.token_id]})
    assert check_usage(backend) == BlockUsage(0, 64)


def test_kv_beyond_num_blocks_is_refused(make: Factory) -> None:
    backend = make(num_blocks=8)  # 32 tokens
    request = Request(tuple(range(1, 21)), SamplingParams(max_tokens=20))  # 40 tokens
    with pytest.raises(OutOfBlocks):
        backend.prefill([request], decode=True)
    assert check_usage(backend) == BlockUsage(0, 8)
    (held,) = backend.prefill([request], decode=False)  # the prompt alone fits: 5 blocks
    assert check_usage(backend) == BlockUsage(5, 3)
    with pytest.raises(OutOfBlocks):
        backend.prefill([Request(tuple(range(1, 17)), GREEDY)], decode=False)  # 4 more blocks
    assert backend.free(held.seq_id) and check_usage(backend) == BlockUsage(0, 8)


def test_usage_is_never_negative(make: Factory, transport: Any) -> None:
    backend = make(num_blocks=32)
    seen = [check_usage(backend)]
    for round_ in range(3):
        outs = backend.prefill([Request((1, 5 + round_), GREEDY), Request(PROMPT, GREEDY)], decode=True)
        (held,) = backend.prefill([Request(PROMPT, GREEDY)], decode=False)
        seen.append(check_usage(backend))
        backend.free(outs[0].seq_id)
        backend.free(outs[0].seq_id)
        backend.free(held.seq_id)
        seen.append(check_usage(backend))
        drain(backend, {outs[1].seq_id: [outs[1].token_id]})
        backend.free(outs[1].seq_id)
        seen.append(check_usage(backend))
    assert seen[-1] == BlockUsage(0, 32)
    assert max(u.used for u in seen) > 0


# ---------------------------------------------------------------------------- TensorRT-LLM adapter only


def test_trtllm_adapter_needs_tensorrt_llm_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # as on a machine without it
    with pytest.raises(ImportError, match="tensorrt_llm"):
        TrtllmBackend(TrtllmConfig(model=tiny_model_dir))


def test_trtllm_config_is_validated(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"^unknown key\(s\) num_block$"):
        TrtllmConfig.from_dict({"model": str(tiny_model_dir), "num_block": 3})
    with pytest.raises(ConfigError, match=r"^num_blocks: must be an integer"):
        TrtllmConfig.from_dict({"model": str(tiny_model_dir), "num_blocks": "3"})
    built = TrtllmConfig.from_dict({"model": str(tiny_model_dir), "eos_token_ids": [2], "ttl_s": 5})
    assert built == TrtllmConfig(model=tiny_model_dir, eos_token_ids=(2,), ttl_s=5.0)
    with pytest.raises(ValueError, match="power of two"):
        TrtllmConfig(model=tiny_model_dir, tokens_per_block=12)
    with pytest.raises(ValueError, match="transceiver_backend"):
        TrtllmConfig(model=tiny_model_dir, transceiver_backend="carrier-pigeon")
    assert "secret" not in repr(TrtllmConfig(model=tiny_model_dir, secret=SECRET))


def test_trtllm_matches_the_reference_engine(
    make_trtllm: Factory, tiny_model_dir: Path, transport: Any
) -> None:
    """Through the fake, which samples with the reference engine, the adapter's mapping of every
    sampling parameter must give the reference engine's tokens."""
    reference = _make_torch(tiny_model_dir, transport, 4, 64)
    backend = make_trtllm()
    for params in (GREEDY, SAMPLED, SamplingParams(max_tokens=9, temperature=0.7, top_p=0.8, seed=3)):
        request = Request(PROMPT, params)
        assert generate(backend, request) == generate(reference, request)
    (llm,) = fake_trtllm.LLM.instances
    kind, result = llm.submitted[0]
    assert kind == "context_and_generation"
    sent = result.sampling_params
    assert (sent.top_k, sent.max_tokens, sent.min_tokens, sent.detokenize) == (1, 12, 12, False)
    assert llm.kv_cache_config.max_tokens == 64 * 4 and llm.kv_cache_config.enable_block_reuse is False


def test_trtllm_handoff_uses_context_and_generation_only_requests(
    make_trtllm: Factory, transport: Any
) -> None:
    exporter, importer = make_trtllm(), make_trtllm()
    out, exported, imported = handoff(exporter, importer, Request(PROMPT, GREEDY), transport)
    ctx_llm, gen_llm = fake_trtllm.LLM.instances
    assert [k for k, _ in ctx_llm.submitted] == ["context_only"]
    assert [k for k, _ in gen_llm.submitted] == ["generation_only"]
    # The prompt and the prefill's token travel in the signed body, in the clear; no KV bytes do.
    body = json.loads(json.loads(exported.descriptor)["b"])
    assert body["state"]["generated_token_ids"] == [out.token_id]
    assert body["trtllm"]["first_gen_tokens"] == [out.token_id] and "opaque_state" in body["trtllm"]
    drain(importer, {imported.seq_id: [out.token_id]})
    exporter.free(out.seq_id)


def test_trtllm_refuses_an_expired_or_foreign_descriptor(make_trtllm: Factory, transport: Any) -> None:
    now = [1_800_000_000.0]
    exporter = make_trtllm(clock=lambda: now[0], ttl_s=5.0)
    (out,) = exporter.prefill([Request(PROMPT, GREEDY)], decode=False)
    exported = exporter.export_sequence(out.seq_id, transport)
    with pytest.raises(DescriptorError, match="another model"):
        make_trtllm(model_id="another-model").import_sequence(exported.state, exported.descriptor, transport)
    importer = make_trtllm(clock=lambda: now[0])
    state_type = type(exported.state)
    for wrong in (
        state_type(PROMPT, (out.token_id + 1,), GREEDY),
        state_type(PROMPT, (out.token_id,), SamplingParams(max_tokens=20, min_length=12)),
        state_type((*PROMPT[:-1], 99), (out.token_id,), GREEDY),
    ):
        with pytest.raises(InvalidRequest, match="does not match"):
            importer.import_sequence(wrong, exported.descriptor, transport)
    now[0] += 6.0
    with pytest.raises(LeaseExpired):
        importer.import_sequence(exported.state, exported.descriptor, transport)
    assert check_usage(importer).used == 0
    exporter.free(out.seq_id)


def test_trtllm_import_after_the_exporter_freed_fails_cleanly(make_trtllm: Factory, transport: Any) -> None:
    exporter, importer = make_trtllm(), make_trtllm()
    (out,) = exporter.prefill([Request(PROMPT, GREEDY)], decode=False)
    exported = exporter.export_sequence(out.seq_id, transport)
    exporter.free(out.seq_id)  # aborts the context request: the fake transceiver drops the KV
    _poll(lambda: fake_trtllm.held_kv() == 0, "the context KV to be dropped")
    with pytest.raises(TransferError):
        importer.import_sequence(exported.state, exported.descriptor, transport)
    assert check_usage(importer) == BlockUsage(0, 64) and importer.decode_step() == []


def test_trtllm_decode_step_returns_every_token_produced_since_the_last(make_trtllm: Factory) -> None:
    backend = make_trtllm()
    (out,) = backend.prefill([Request(PROMPT, GREEDY)], decode=True)
    (llm,) = fake_trtllm.LLM.instances
    _poll(llm.idle, "the fake engine to finish the stream")
    _poll(lambda: not _readers(), "the reader to pass the last response on")
    outs = backend.decode_step()
    assert [o.seq_id for o in outs] == [out.seq_id] * (GREEDY.max_tokens - 1)
    assert [o.finished for o in outs] == [False] * (GREEDY.max_tokens - 2) + [True]
    assert check_usage(backend).used == 0


def test_trtllm_a_failed_stream_is_reported_and_others_lose_nothing(make_trtllm: Factory) -> None:
    backend = make_trtllm(num_blocks=600)
    long = SamplingParams(max_tokens=2000, min_length=2000)  # still running when it is cancelled
    doomed, fine = backend.prefill([Request((1, 2, 3), long), Request(PROMPT, GREEDY)], decode=True)
    (llm,) = fake_trtllm.LLM.instances
    llm.cancel(llm.submitted[0][1].request_id)  # TensorRT-LLM ends the request on its own
    stream = {fine.seq_id: [fine.token_id]}
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert time.monotonic() < deadline, "the failed stream was never reported"
        try:
            for o in backend.decode_step():
                if o.seq_id == fine.seq_id:
                    stream[o.seq_id].append(o.token_id)
        except SequenceFailed as exc:
            assert exc.seq_ids == [doomed.seq_id]
            break
    assert backend.free(doomed.seq_id) is False, "a failed sequence is freed"
    if len(stream[fine.seq_id]) < GREEDY.max_tokens:
        drain(backend, stream)
    assert len(stream[fine.seq_id]) == GREEDY.max_tokens
    assert check_usage(backend) == BlockUsage(0, 600)
