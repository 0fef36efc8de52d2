"""perf/hot_prompts.py's pure parts: the burst trace (steady unique traffic plus a burst sharing one
prefix), the windows its summary reads, the chat trace, and the report from its JSON."""

from __future__ import annotations

import json

import pytest

from perf import hot_prompts as hp
from perf.benchlib.metrics import RequestRecord, Slo
from perf.benchlib.workload import PromptFactory, new_salt


@pytest.fixture(scope="module")
def factory(tiny_model_dir) -> PromptFactory:
    return PromptFactory.from_model_dir(tiny_model_dir)


def _args(*extra: str):
    return hp.parse_args(
        ["--burst-at", "5", "--burst-count", "30", "--burst-rate", "10", "--tail", "2", *extra]
    )


def test_the_burst_shares_one_long_prefix_and_the_others_share_nothing(factory):
    args = _args("--prefix-tokens", "96", "--other-tokens", "40")
    trace = hp.burst_trace(args, factory, new_salt())
    hot = [s for s in trace if s.kind == "hot"]
    others = [s for s in trace if s.kind == "other"]
    assert len(hot) == 30 and all(s.arrival >= 5 for s in hot)
    assert [s.index for s in trace] == list(range(len(trace))) and trace == sorted(
        trace, key=lambda s: s.arrival
    )
    assert hp.shared_prefix_tokens(factory, hot) >= 96, "the whole prefix, and no more than its tail's start"
    assert hp.shared_prefix_tokens(factory, hot) < min(s.prompt_tokens for s in hot)
    assert hp.shared_prefix_tokens(factory, others) < 8, "unique prompts share at most the salt"
    assert all(s.prompt_tokens == 40 and s.output_tokens == args.other_output for s in others)
    assert others[-1].arrival < 5 + 3 + 2, "other users keep coming until the tail's end"


def _record(i: int, kind: str, arrival: float, ttft: float, ok: bool = True) -> RequestRecord:
    first = arrival + ttft
    return RequestRecord(
        i, arrival, arrival, first, first + 0.1, 11, 11, 10, 11, None if ok else "refused", kind
    )


def test_the_summary_splits_other_users_before_and_during_the_burst():
    args = _args()
    records = [_record(0, "other", 1.0, 0.1), _record(1, "other", 6.0, 2.0), _record(2, "hot", 5.0, 0.5)]
    records += [_record(3, "hot", 7.0, 0.5, ok=False), _record(4, "other", 30.0, 0.1)]
    out = hp.burst_summary(args, records, {"other": Slo(1.0, 0.05), "hot": Slo(1.0, 0.05)})
    assert out["others_before"]["requests"] == 1 and out["others_before"]["ttft_ms_p50"] == pytest.approx(100)
    assert out["others_during"]["requests"] == 1, "arrivals from the burst to its last + tail only"
    assert out["others_during"]["ttft_ms_p50"] == pytest.approx(2000)
    assert out["hot"]["failed"] == 1 and out["hot"]["errors"] == {"refused": 1}
    assert out["attainment"] == pytest.approx(3 / 5), "the slow other user misses its TTFT"


def test_repeated_runs_are_split_each_by_its_own_burst_then_pooled():
    args = _args()
    slos = {"other": Slo(1.0, 0.05), "hot": Slo(1.0, 0.05)}
    # run 1's burst ends at 7 + 2: its other user at 8.5 is during; run 2's ends at 5 + 2: 8.5 is after
    one = [_record(0, "other", 1.0, 0.1), _record(1, "other", 8.5, 0.3), _record(2, "hot", 7.0, 0.5)]
    two = [_record(0, "other", 2.0, 0.2), _record(1, "other", 8.5, 0.3), _record(2, "hot", 5.0, 0.5)]
    out = hp.pooled_summary(args, [one, two], slos)
    assert out["others_before"]["requests"] == 2 and out["others_during"]["requests"] == 1
    assert out["hot"]["requests"] == 2 and out["runs"] == 2
    assert out["tpot_p99_ratio_per_run"] == [pytest.approx(1.0), None], "run 2 had no one during"
    assert out["attainment"] == 1.0 and out["goodput_rps"] == pytest.approx(6 / 17)
    assert "runs" not in hp.burst_summary(args, one, slos), "one run: the figures as before"


def test_the_chat_trace_renders_the_template_so_only_the_system_prompt_is_shared(factory, tmp_path):
    """A template of the model's folder (here a small one); the prompts are tokenized by ``factory``."""
    model = tmp_path / "model"
    model.mkdir()
    template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    args = hp.parse_args(["--model-dir", str(model), "--chat-duration", "5"])
    trace = hp.chat_trace(args, factory, new_salt(), system_tokens=30)
    assert len(trace) >= 3 and all(s.kind == "chat" for s in trace)
    assert all(s.prompt.startswith("<s>system: ") and s.prompt.endswith("assistant:") for s in trace)
    assert 30 <= hp.shared_prefix_tokens(factory, trace) < trace[0].prompt_tokens
