"""The planner's simulator against hand-computed queues, the profile fit, goodput and placements."""

from __future__ import annotations

import pytest

from disagg_tools.planner.lengths import LengthDist, from_buckets, parse_lengths
from disagg_tools.planner.plan import Traffic, goodput, placements, plan
from disagg_tools.planner.profile import DecodePoint, Fit, PrefillPoint, Profile
from disagg_tools.planner.simulator import ROUTING_DRAWS, Deployment, Job, Slo, poisson_jobs, simulate


def constant(prefill_s: float = 0.0, step_s: float = 0.0, **more: object) -> Profile:
    return Profile(Fit((prefill_s, 0.0, 0.0), 0.0, 0.0), Fit((step_s, 0.0, 0.0), 0.0, 0.0), **more)


@pytest.mark.parametrize("rho", [0.3, 0.5, 0.8])
def test_one_prefill_instance_is_an_m_d_1_queue(rho):
    """Poisson arrivals, a deterministic service D, one server: mean wait rho D / (2 (1 - rho))."""
    service = 0.1
    profile = constant(prefill_s=service)
    deployment = Deployment(prefill=(profile,), decode=(profile,), max_prefill_tokens=100)
    jobs = poisson_jobs(rho / service, 20000, LengthDist("fixed", 100), LengthDist("fixed", 1), seed=3)
    outcomes = simulate(deployment, jobs)
    mean_ttft = sum(o.ttft for o in outcomes) / len(outcomes)
    expected = service + rho * service / (2 * (1 - rho))
    assert mean_ttft == pytest.approx(expected, rel=0.05)


def test_decode_steps_the_batch_together_after_the_kv_arrives():
    # a step costs 0.01 s plus 0.01 s per sequence in it: batching shows in the times
    profile = Profile(Fit((0.2, 0.0, 0.0), 0, 0), Fit((0.01, 0.01, 0.0), 0, 0), kv_bytes_per_token=1000)
    deployment = Deployment(prefill=(profile,), decode=(profile,), transfer_bytes_per_s=1e6)
    jobs = [Job(0.0, 100, 4), Job(0.1, 100, 3)]  # 0.1 s of KV each
    first, second = simulate(deployment, jobs)
    assert (first.first_token, second.first_token) == pytest.approx((0.2, 0.4))  # one after the other
    # first: joins at 0.3, steps alone (0.02 s) until second joins at 0.5, then in a batch of 2 (0.03 s)
    # 0.30-0.32, 0.32-0.34, 0.34-0.36: its three decode tokens, alone
    assert first.last_token == pytest.approx(0.36)
    # second: joins at 0.5 (the decoder is idle): two steps alone
    assert second.last_token == pytest.approx(0.5 + 2 * 0.02)
    assert first.tpot == pytest.approx(0.16 / 3)


def test_the_relay_adds_its_cost_per_token_to_every_decode_step():
    """A step of B sequences costs the profile's step plus B x relay_s_per_token, disaggregated and
    colocated alike; prefill steps are the profile's alone."""
    profile = Profile(Fit((0.2, 0.0, 0.0), 0, 0), Fit((0.01, 0.01, 0.0), 0, 0))
    jobs = [Job(0.0, 100, 4), Job(0.0, 100, 4)]
    relay = 0.005
    first, second = simulate(Deployment(prefill=(profile,), decode=(profile,), relay_s_per_token=relay), jobs)
    assert (first.first_token, second.first_token) == pytest.approx((0.2, 0.4))
    # disaggregated: each decodes alone (0.02 + 0.005 a step), the first from 0.2, the second from 0.4
    assert first.last_token == pytest.approx(0.2 + 3 * 0.025)
    assert second.last_token == pytest.approx(0.4 + 3 * 0.025)
    first, second = simulate(Deployment(colocated=(profile,), relay_s_per_token=relay), jobs)
    # the first prompt's step starts on its arrival (0.2 s, no relay), a decode step of one (0.025,
    # its 2nd token at 0.225), the second prompt (0.2 s, first token 0.425), then steps of two
    # (0.03 + 2 x 0.005): 0.465 and 0.505 (the first's last), and one of one for the second (0.53)
    assert (first.first_token, second.first_token) == pytest.approx((0.2, 0.425))
    assert (first.last_token, second.last_token) == pytest.approx((0.505, 0.53))
    with pytest.raises(ValueError):
        Deployment(colocated=(profile,), relay_s_per_token=-0.001)


def test_a_prefill_step_yields_its_core_to_the_relay_of_the_tokens_streamed_meanwhile():
    """Disaggregated, the entry points beside the prefill instance: a prefill step lasts
    prefill_relay_s_per_token longer per token decode produced while it ran, and again for those
    produced in that extension."""
    profile = constant(prefill_s=0.2, step_s=0.01)
    jobs = [Job(0.0, 100, 41), Job(0.255, 100, 1)]
    plain = simulate(Deployment(prefill=(profile,), decode=(profile,)), jobs)
    assert plain[1].first_token == pytest.approx(0.455)
    relayed = Deployment(prefill=(profile,), decode=(profile,), prefill_relay_s_per_token=0.001)
    first, second = simulate(relayed, jobs)
    # the first decodes from 0.2, a token every 0.01 s; the second's prefill computes 0.255-0.455, while
    # 20 tokens stream (0.26-0.45): +0.02 s; 2 more meanwhile (0.46, 0.47): +0.002 s; none by 0.477
    assert second.first_token == pytest.approx(0.477)
    assert first.last_token == pytest.approx(plain[0].last_token), "decode steps are not slowed by it"


def test_a_colocated_prefill_stalls_the_decode_batch():
    profile = constant(prefill_s=0.5, step_s=0.01)
    jobs = [Job(0.0, 10, 11), Job(0.005, 2000, 1)]
    short, long_ = simulate(Deployment(colocated=(profile,)), jobs)
    # step 1: the short prompt (0.5 s), then a decode step (its 2nd token at 0.51); step 2: the long
    # prompt, which arrived meanwhile (0.5 s), then a decode step (3rd token at 1.02); 8 more steps
    assert (short.first_token, long_.first_token) == pytest.approx((0.5, 1.01))
    assert short.last_token == pytest.approx(1.02 + 8 * 0.01)
    assert short.tpot == pytest.approx(0.06)
    # prefill time proportional to tokens, in chunks of 250 beside each decode step: the long prompt
    # is spread over 8 steps; the short one's decode waits as long in total, in smaller pieces
    linear = Profile(Fit((0.0, 2.5e-4, 0.0), 0, 0), Fit((0.01, 0.0, 0.0), 0, 0))
    whole = simulate(Deployment(colocated=(linear,)), jobs)
    chunked = simulate(Deployment(colocated=(linear,), chunk_tokens=250), jobs)
    assert chunked[0].tpot == pytest.approx(whole[0].tpot)
    # (the first step is the short prompt's alone: the long one arrives during it)
    assert chunked[1].first_token == pytest.approx(0.0025 + 0.01 + 7 * (0.0625 + 0.01) + 0.0625)
    # disaggregated: the decode batch never waits for a prefill
    disagg = simulate(Deployment(prefill=(profile,), decode=(profile,)), jobs)
    assert disagg[0].tpot == pytest.approx(0.01)


def test_profile_fit_recovers_known_coefficients_and_round_trips(tmp_path):
    def pre(prompts):
        return 0.002 + 1e-4 * sum(prompts) + 2e-8 * sum(p * p for p in prompts)

    def dec(batch, context):
        return 0.01 + 5e-4 * batch + 1e-6 * context

    prefill = [PrefillPoint(p, pre(p)) for p in [(16,), (64,), (256,), (1024,), (128, 128), (64,) * 4]]
    decode = [DecodePoint(b, c, dec(b, c)) for b, c in [(1, 64), (4, 256), (8, 2048), (16, 512), (2, 4096)]]
    profile = Profile.fitted(prefill, decode, cores=(0,), model="m", dtype="bfloat16", kv_bytes_per_token=9)
    assert profile.prefill.coefficients == pytest.approx((0.002, 1e-4, 2e-8), rel=1e-6)
    assert profile.decode.coefficients == pytest.approx((0.01, 5e-4, 1e-6), rel=1e-6)
    assert profile.prefill.max_error < 1e-9 and profile.decode.mean_error < 1e-9
    path = tmp_path / "p.json"
    path.write_text(profile.to_json())
    assert Profile.load(path) == profile
    with pytest.raises(ValueError, match="at least 3"):
        Profile.fitted(prefill[:2], decode)
    with pytest.raises(ValueError, match="version"):
        Profile.from_json("{}")


def test_goodput_grows_with_instances_and_the_plan_ranks_per_core():
    one = constant(prefill_s=0.1, step_s=0.02)
    traffic = Traffic(LengthDist("fixed", 100), LengthDist("fixed", 8), count=200)
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    single, _ = goodput(Deployment(prefill=(one,), decode=(one,), max_prefill_tokens=100), traffic, slo)
    double, _ = goodput(Deployment(prefill=(one,) * 2, decode=(one,), max_prefill_tokens=100), traffic, slo)
    assert 0 < single < 10 and double > 1.5 * single  # prefill-bound: a second instance nearly doubles it
    assert goodput(Deployment(prefill=(one,), decode=(one,)), traffic, Slo(0.05, 0.05))[0] == 0.0
    names = [name for name, _, _ in placements(3, {1: one, 2: one}, chunk_tokens=64)]
    assert names == [
        "disaggregated 1P:2D",
        "disaggregated 2P:1D",
        "colocated 3x1 cores",
        "colocated 3x1 cores, chunks of 64",
        "colocated 1x2 cores",
        "colocated 1x2 cores, chunks of 64",
    ]


def test_the_plan_charges_the_relay_to_every_placement():
    """A relay term that makes a batch of 8 miss its TPOT (0.02 + 8 x 0.004 > 0.05) lowers every
    placement's goodput, colocated and disaggregated."""
    one = constant(prefill_s=0.02, step_s=0.02)
    traffic = Traffic(LengthDist("fixed", 100), LengthDist("fixed", 32), count=100)
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    ranked = plan(2, {1: one}, traffic, slo)
    free = {p.name: p.goodput_rps for p in ranked}
    relayed = {p.name: p.goodput_rps for p in plan(2, {1: one}, traffic, slo, relay_s_per_token=0.004)}
    assert free.keys() == relayed.keys() and len(free) == 2
    assert all(0 < relayed[name] < 0.9 * free[name] for name in free), (free, relayed)
    # the entry points' CPU on the prefill core: only the disaggregated placement pays it
    busy = {p.name: p.goodput_rps for p in plan(2, {1: one}, traffic, slo, prefill_relay_s_per_token=0.004)}
    assert busy["colocated 2x1 cores"] == free["colocated 2x1 cores"]
    assert busy["disaggregated 1P:1D"] < 0.9 * free["disaggregated 1P:1D"], (free, busy)
    assert [p.per_core for p in ranked] == sorted((p.per_core for p in ranked), reverse=True)
    assert all(p.ttft_p90_s is not None for p in ranked if p.goodput_rps)


def test_lengths_parse():
    assert parse_lengths("lognormal:300:0.5") == LengthDist("lognormal", 300, 0.5)
    assert parse_lengths("fixed:64").sample(__import__("numpy").random.default_rng(0), 2) == [64, 64]
    with pytest.raises(ValueError, match="lognormal:MEDIAN:SIGMA"):
        parse_lengths("gamma:1")


def test_lengths_from_a_histograms_buckets_keep_its_shape():
    import numpy as np

    inf = float("inf")
    # a bimodal histogram: 80 short prompts in (16, 32], 20 long ones in (512, 1024], none between
    bounds = (16.0, 32.0, 64.0, 512.0, 1024.0, inf)
    cumulative = (0.0, 80.0, 80.0, 80.0, 100.0, 100.0)
    dist = from_buckets(bounds, cumulative)
    assert dist.kind == "buckets" and dist.buckets == ((16.0, 32.0, 80.0), (512.0, 1024.0, 20.0))
    drawn = dist.sample(np.random.default_rng(0), 5000)
    assert all(17 <= x <= 32 or 513 <= x <= 1024 for x in drawn), "only where the histogram saw lengths"
    assert sum(x > 512 for x in drawn) / len(drawn) == pytest.approx(0.2, abs=0.02)
    assert dist.sample(np.random.default_rng(7), 50) == dist.sample(np.random.default_rng(7), 50)
    assert dist.median() == 26  # the 50th of 100 is the 50th of the 80 in (16, 32]: 16 + 16 x 50 / 80
    # lengths past the highest finite bound (+Inf bucket) lie between it and the longest a request holds
    tail = from_buckets((64.0, inf), (0.0, 10.0), hi=100)
    assert tail.buckets == ((64.0, 100.0, 10.0),)
    assert all(65 <= x <= 100 for x in tail.sample(np.random.default_rng(1), 200))
    with pytest.raises(ValueError, match="nothing observed"):
        from_buckets(bounds, (0.0,) * 6)
    with pytest.raises(ValueError, match="ordered ranges"):
        LengthDist("buckets", 0, buckets=((32.0, 16.0, 1.0),))
    with pytest.raises(ValueError, match="only for kind buckets"):
        LengthDist("fixed", 3, buckets=((0.0, 16.0, 1.0),))


def test_profile_and_plan_commands(tmp_path, tiny_model_dir, capsys):
    import subprocess
    import sys

    from disagg_tools.planner.cli import plan_main

    out = tmp_path / "p1.json"
    # in a process of its own: the engine pins the process that runs it to the profiled cores
    command = [
        sys.executable,
        "-m",
        "disagg_tools.cli",
        "profile",
        "--model",
        str(tiny_model_dir),
        "--cores",
        "0",
    ]
    # float32: what an AVX2-only CPU computes fastest (bf16 there is 5x slower); the fit is what is tested
    command += ["--quick", "--repeats", "1", "--dtype", "float32", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    printed = done.stdout
    assert "prefill fit: mean error" in printed and "decode fit: mean error" in printed
    profile = Profile.load(out)
    assert profile.cores == (0,) and profile.kv_bytes_per_token > 0
    assert len(profile.prefill_points) >= 3 and all(p.seconds > 0 for p in profile.decode_points)
    argv = ["--cores", "2", "--profile", f"1={out}", "--ttft", "2", "--tpot", "0.2", "--requests", "60"]
    assert plan_main(argv) == 0
    table = capsys.readouterr().out
    assert "| disaggregated 1P:1D | 2 |" in table and "| colocated 2x1 cores | 2 |" in table
    assert "recommended (predicted, not measured):" in table
    assert (
        plan_main(["--cores", "2", "--profile", f"1={tmp_path / 'none.json'}", "--ttft", "1", "--tpot", "1"])
        == 2
    )


def test_a_busy_prefill_instance_counts_the_prompt_it_is_on():
    """Two prefill instances, two prompts at once: the second goes to the idle instance, not behind
    the first on the busy one (whose queue is empty while it works)."""
    profile = Profile(Fit((0.0, 0.001, 0.0), 0, 0), Fit((0.001, 0.0, 0.0), 0, 0))
    deployment = Deployment(prefill=(profile, profile), decode=(profile,))
    first, second = simulate(deployment, [Job(0.0, 100, 1), Job(0.0, 100, 1)])
    assert first.ttft == pytest.approx(0.1) and second.ttft == pytest.approx(0.1)


def test_random_routing_pools_several_draws_and_can_put_two_requests_on_one_instance():
    """Least loaded, two prompts arriving together go to the two instances and finish together;
    random (Triton's load-oblivious assignment), each of ROUTING_DRAWS seeded draws may put both on
    one instance, where the second waits its turn; the outcomes of all the draws come back together."""
    profile = constant(prefill_s=0.2, step_s=0.01)
    jobs = [Job(0.0, 100, 1), Job(0.0, 100, 1)]
    spread = simulate(Deployment(colocated=(profile, profile)), jobs)
    assert [o.first_token for o in spread] == pytest.approx([0.2, 0.2])
    drawn = simulate(Deployment(colocated=(profile, profile), routing="random"), jobs)
    assert len(drawn) == ROUTING_DRAWS * len(jobs)
    firsts = sorted(round(o.first_token, 6) for o in drawn)
    assert set(firsts) <= {0.2, 0.4} and 0.4 in firsts, firsts  # some draw put both on one instance
    assert firsts.count(0.2) > firsts.count(0.4), "the first of each pair is never late"
    again = simulate(Deployment(colocated=(profile, profile), routing="random"), jobs)
    assert [o.first_token for o in again] == [o.first_token for o in drawn], "seeded: the same draws"
    with pytest.raises(ValueError, match="routing"):
        Deployment(colocated=(profile,), routing="round_robin")


def test_the_plan_routes_at_random_by_default():
    """Two one-core instances under load: a router that knows their queues serves more than Triton's
    load-oblivious assignment, which the plan models unless told otherwise."""
    # prompts cost 1 ms a token, a decode step 5 ms plus 2 ms a sequence
    one = Profile(Fit((0.0, 0.001, 0.0), 0, 0), Fit((0.005, 0.002, 0.0), 0, 0))
    traffic = Traffic(LengthDist("lognormal", 100, 0.8), LengthDist("fixed", 16), count=100)
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    default = {p.name: p.goodput_rps for p in plan(2, {1: one}, traffic, slo)}
    oblivious = {p.name: p.goodput_rps for p in plan(2, {1: one}, traffic, slo, routing="random")}
    aware = {p.name: p.goodput_rps for p in plan(2, {1: one}, traffic, slo, routing="least_loaded")}
    assert default == oblivious
    assert oblivious["colocated 2x1 cores"] < aware["colocated 2x1 cores"], (oblivious, aware)
    assert oblivious["disaggregated 1P:1D"] == aware["disaggregated 1P:1D"], "one instance a pool: no choice"


def test_an_elastic_pair_prefills_on_both_cores_while_decode_is_idle_and_paces_decode_otherwise():
    """Elastic: decode idle, the prompt runs at the loan's full speed-up; decoding with a step of 0.01 s
    under a budget of 0.04 s, three quarters of the core is lent (factor 1 + 0.6 x 0.75), and every
    decode step while a prompt waits lasts the budget."""
    profile = constant(prefill_s=0.2, step_s=0.01)
    elastic = Deployment(prefill=(profile,), decode=(profile,), lend_tpot_s=0.04, loan_speedup=1.6)
    first, second = simulate(elastic, [Job(0.0, 100, 10), Job(0.13, 100, 2)])
    assert first.first_token == pytest.approx(0.2 / 1.6)
    assert second.first_token == pytest.approx(0.13 + 0.2 / (1 + 0.6 * 0.75))
    # the first's 9 decode steps from 0.125: one alone (0.01), four paced while the second prefills
    # (0.04 each, to 0.295), then four of 0.01
    assert first.last_token == pytest.approx(0.125 + 0.01 + 4 * 0.04 + 4 * 0.01)
    static_first, static_second = simulate(
        Deployment(prefill=(profile,), decode=(profile,)), [Job(0.0, 100, 10), Job(0.13, 100, 2)]
    )
    assert static_second.first_token == pytest.approx(0.4)  # after the first, 0.2 s each on one core
    assert static_first.tpot == pytest.approx(0.01)


def test_the_plan_offers_the_elastic_pair_on_two_cores_with_both_profiles():
    one, two = constant(prefill_s=0.3, step_s=0.01), constant(prefill_s=0.2, step_s=0.008)
    names = [name for name, _, _ in placements(2, {1: one, 2: two}, lend_tpot_s=0.03)]
    assert "disaggregated 1P:1D, decode lends its core (30 ms a token)" in names
    (elastic,) = [d for name, d, _ in placements(2, {1: one, 2: two}, lend_tpot_s=0.03) if "lends" in name]
    assert elastic.loan_speedup == pytest.approx(1.5)
    assert not [n for n, _, _ in placements(2, {1: one, 2: two}) if "lends" in n]  # not asked for
    assert not [n for n, _, _ in placements(3, {1: one, 2: two}, lend_tpot_s=0.03) if "lends" in n]
    with pytest.raises(ValueError, match="one prefill and one decode"):
        Deployment(prefill=(one, one), decode=(one,), lend_tpot_s=0.03)
