"""The markdown report (perf/RESULTS.md) rendered from a results dict; pure text, no I/O."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from perf.benchlib.search import Bracket

GOODPUT_TARGETS = {"codegen": 1.3, "chat": 1.3, "codegen@article": 1.3, "summarize": 2.0}
"""Disaggregated goodput against the best other deployment, per workload: the ratio wanted."""
INTERFERENCE_TARGET = 1.2
"""Disaggregated short-request TPOT p99, mixed / decode-only, pooled over the seeds: at most this."""
OURS = "disagg"

UNIQUE_PROMPTS_NOTE = (
    "Every prompt is unique: it starts with a per-request nonce and continues with seeded random "
    "vocabulary words, with a fresh salt for every run, so no prefix cache (vLLM's automatic prefix "
    "caching, or ours) can answer any part of a prompt from memory; every TTFT includes a full prefill."
)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.1f}"


def _rate(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _ratio(num: float | None, den: float | None) -> str:
    if num is None or not den:
        return "–"
    return f"{num / den:.2f}×"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _placement(interference: dict[str, Any], top: int = 8) -> list[str]:
    """Table of CPU seconds per process and core during each deployment's mixed run (when probed)."""
    probed = {
        name: res["mixed"]["cpu"] for name, res in interference.items() if res.get("mixed", {}).get("cpu")
    }
    if not probed:
        return []
    cpus = sorted(
        {c for usage in probed.values() for per in usage.values() for c in per}, key=lambda c: int(c[3:])
    )
    rows = []
    for name, usage in probed.items():
        for process, per in list(usage.items())[:top]:
            rows.append(
                [name, process, *(f"{per.get(c, 0.0):.1f}" for c in cpus), f"{sum(per.values()):.1f}"]
            )
    out = [
        "### Where CPU time went in the mixed run",
        "",
        "CPU seconds per process and core, sampled from /proc every 0.1 s (threads charged to the core they "
        "were last seen on; the per-process totals are exact). Only processes started by the benchmark "
        "and the load generator itself are watched.",
        "",
        *_table(["deployment", "process", *(f"{c} (s)" for c in cpus), "total (s)"], rows),
        "",
    ]
    decode = probed.get("disagg", {}).get("stub:decode")
    if decode:
        core = max(decode, key=decode.get)
        others = {p: per.get(core, 0.0) for p, per in probed["disagg"].items() if p != "stub:decode"}
        shared = sum(others.values())
        top_three = ", ".join(f"{p} {v:.1f} s" for p, v in sorted(others.items(), key=lambda kv: -kv[1])[:3])
        out += [
            f"Disaggregated: the decode engine ran on {core} ({decode[core]:.1f} s); other processes took "
            f"{shared:.1f} s of that core during the mixed run ({shared / decode[core]:.0%} of decode's "
            f"time; most: {top_three}).",
            "",
        ]
    return out


def _alone(figures: dict[str, Any] | None) -> str:
    """A deployment's figures alone (`results["alone"]`), or why there are none."""
    if not figures:
        return "–"
    if "error" in figures:
        return f"failed: {figures['error'][:80]}"
    return f"{_ms(figures['ttft_s'])} / {_ms(figures['tpot_s'])}"


def _prompt_bound(results: dict[str, Any]) -> list[str]:
    """Goodput against each deployment's prompt-serving bound: 1 / its TTFT alone is the rate at which
    its prompts would be served back to back (every TTFT includes the whole prefill), so goodput near
    that bound says the prompts, not the tokens, limit the deployment."""
    rows = []
    for workload, per_dep in results.get("goodput", {}).items():
        alone = results.get("alone", {}).get(workload, {})
        for name, res in per_dep.items():
            figures = alone.get(name) or {}
            ttft = figures.get("ttft_s")
            if not ttft:
                continue
            bound = 1.0 / ttft
            rows.append([
                workload, name, _ms(ttft), _ms(figures.get("tpot_s")), f"{bound:.2f}",
                _rate(res["goodput_rps"]), f"{res['goodput_rps'] / bound:.0%}",
            ])  # fmt: skip
    if not rows:
        return []
    header = ["workload", "deployment", "TTFT alone (ms)", "TPOT alone (ms)", "prompts/s back to back",
              "goodput (req/s)", "goodput / bound"]  # fmt: skip
    return [
        "### What bounds each deployment: its prompts",
        "",
        "Alone, a request's TTFT is its whole prefill plus the path to its first token, so 1 / TTFT alone is "
        "the rate at which a deployment would serve prompts one at a time, back to back, with nothing else "
        "to do. Goodput close to that rate means prompt processing limits the deployment (a queue of "
        "prompts within the TTFT SLO); far below it, the tokens or the SLOs do. Prompts prefilled together "
        "in one step can go past it (long prompts queued in the prefill pool).",
        "",
        *_table(header, rows),
        "",
    ]


def _verdict(ok: bool | None) -> str:
    return "–" if ok is None else ("met" if ok else "**missed**")


def best_other(per_dep: dict[str, Any], ours: str = OURS) -> tuple[str, Bracket] | None:
    """The other deployment whose bracket reaches highest (its high end, or its low end when open)."""
    others = [(name, Bracket.of(res)) for name, res in per_dep.items() if name != ours]
    if not others:
        return None

    def reach(item: tuple[str, Bracket]) -> float:
        b = item[1]
        return float("inf") if b.high is None and b.low > 0 else (b.high if b.high is not None else b.low)

    return max(others, key=reach)


def _targets(results: dict[str, Any], orchestration: dict[str, Any] | None) -> list[str]:
    """The open targets, checked against this run's figures by the bracket rule (a reading, not a timed
    test): ours meets ratio x another's goodput only when the low end of our bracket is at least ratio
    x the high end of theirs."""
    rows = []
    for workload, per_dep in results.get("goodput", {}).items():
        ratio = GOODPUT_TARGETS.get(workload)
        if ratio is None or OURS not in per_dep:
            continue
        ours, other = Bracket.of(per_dep[OURS]), best_other(per_dep)
        if other is None:
            continue
        name, theirs = other
        sure = "–" if not theirs.high else f"{ours.low / theirs.high:.2f}×"
        shown = f"{ours.text()} vs {name} {theirs.text()}: low / high {sure}"
        # the rule; a miss says where ours stands (`_against`): above by less than the ratio, a tie, below
        missed = {"below": "missed (below)", "tie (overlap)": "missed (tie: brackets overlap)"}
        verdict = "met"
        if not ours.at_least(theirs, ratio):
            verdict = f"**{missed.get(_against(ours, theirs), 'missed')}**"
        rows.append([f"{workload} goodput, disaggregated vs the best other", f"≥ {ratio:g}×", shown, verdict])
    inter = results.get("interference", {})

    def p99_ratio(name: str) -> float | None:
        res = inter.get(name)
        if not res or not res.get("mixed_tpot_p99") or not res.get("decode_only_tpot_p99"):
            return None
        return res["mixed_tpot_p99"] / res["decode_only_tpot_p99"]

    own = p99_ratio(OURS)
    seeds = inter.get(OURS, {}).get("seeds", [1])
    others = ", ".join(f"{n} {r:.2f}×" for n in inter if n != OURS and (r := p99_ratio(n)) is not None)
    what = (
        f"interference: disaggregated short-request TPOT p99, mixed / decode-only, {len(seeds)} seeds pooled"
    )
    rows.append([what, f"≤ {INTERFERENCE_TARGET:g}×",
                 "–" if own is None else f"{own:.2f}× ({others})" if others else f"{own:.2f}×",
                 _verdict(None if own is None else own <= INTERFERENCE_TARGET)])  # fmt: skip
    if orchestration:
        worst = max(orchestration["overhead_vs_engine_loop"].values())
        shown = ", ".join(f"{k} {v:+.1%}" for k, v in orchestration["overhead_vs_engine_loop"].items())
        rows.append(["orchestration: TPOT through Triton vs the decode engine loop, one stream", "< 5 %",
                     shown, _verdict(worst < 0.05)])  # fmt: skip
    return [
        "## Targets",
        "",
        "Goodputs are brackets [highest rate that met, lowest that missed). A target is met only when the "
        "low end of ours is at least the ratio × the high end of the best other's; overlapping brackets "
        "are a tie, whatever the rates inside them.",
        "",
        *_table(["target", "wanted", "this run", ""], rows),
        "",
    ]


def _fresh(res: dict[str, Any]) -> str:
    """When a figure was measured: this run, or the earlier run it was carried from."""
    return f"earlier run {res['from_run'][:16]}" if res.get("from_run") else "this run"


def _against(ours: Bracket, other: Bracket) -> str:
    """Our bracket against another's: above, below, or a tie (overlapping)."""
    if ours.at_least(other):
        return "above"
    if other.at_least(ours):
        return "below"
    return "tie (overlap)"


def _freshness(results: dict[str, Any]) -> list[str]:
    """Which parts of the report this run measured, and which it carried from earlier runs."""
    meta = results["meta"]
    fresh, carried = [], []
    for workload, per_dep in results.get("goodput", {}).items():
        for name, res in per_dep.items():
            (carried if res.get("from_run") else fresh).append((f"{workload} × {name}", res.get("from_run")))
    for name, res in results.get("interference", {}).items():
        (carried if res.get("from_run") else fresh).append((f"interference × {name}", res.get("from_run")))
    reused = [
        (f"{kind.removesuffix('_grid')}: {e['config']}", e.get("measured", "?"))
        for kind, grid in results.items() if kind.endswith("_grid") and isinstance(grid, dict)
        for e in grid.get("tried", []) if e.get("reused")
    ]  # fmt: skip
    if not carried and not reused:
        return []
    out = ["## What this run measured", ""]
    out.append(
        f"This run ({meta.get('started', '?')[:16]}) measured: "
        + (", ".join(f"`{what}`" for what, _ in fresh) or "no goodput or interference figure")
        + "."
    )
    out.append("")
    if carried:
        out.append("Carried from earlier runs (--keep-earlier), not measured now:")
        out += [f"- `{what}`: run of {when[:16]}" for what, when in carried]
        out.append("")
    if reused:
        out.append("Grid configurations taken from the grid cache (--reuse-grids), not tuned again:")
        out += [f"- {what}: measured {when[:16]}" for what, when in reused]
        out.append("")
    return out


def _grid_section(results: dict[str, Any], kind: str, title: str) -> list[str]:
    """The configurations tried for deployment `kind`, each with its bracket and when it was measured."""
    grid = results.get(f"{kind}_grid")
    if not (grid and grid.get("tried")):
        return []
    top = next(e for e in grid["tried"] if e["config"] == grid["best"])
    top_bracket = Bracket.of(top) if top.get("bracket") else None
    tied = [
        e["config"] for e in grid["tried"]
        if e["config"] != grid["best"] and e.get("goodput_rps") is not None
        and (
            Bracket.of(e).overlaps(top_bracket) if top_bracket and e.get("bracket")
            else e["goodput_rps"] == top["goodput_rps"]
        )
    ]  # fmt: skip
    tie = ""
    if tied:
        tie = (
            f" It tied with {'; '.join(tied)} (overlapping brackets at the quick plan's resolution); the "
            "first listed is taken."
        )
    out = [
        f"## {title} at its best: the configurations tried",
        "",
        f"Each configuration's goodput on `{grid['workload']}` ({grid['plan']} plan, the same SLOs); the "
        f"best, **{grid['best']}**, is the one measured in full as `{kind}` below.{tie}",
        "",
    ]
    rows = []
    for e in grid["tried"]:
        goodput = _rate(e["goodput_rps"]) if e["goodput_rps"] is not None else f"failed: {e['error']}"
        bracket = Bracket.from_dict(e["bracket"]).text() if e.get("bracket") else "–"
        when = f"reused, {e['measured'][:16]}" if e.get("reused") else "this run"
        rows.append([e["config"], goodput, bracket, when, f"`{e['command']}`"])
    return [
        *out,
        *_table(["configuration", "goodput (req/s)", "bracket", "measured", "command line"], rows),
        "",
    ]


def orchestration_section(orchestration: dict[str, Any]) -> list[str]:
    """The orchestration-cost table and its split, for this report and `perf/orchestration_cost.py`."""
    tpot, steps = orchestration["tpot_ms"], orchestration.get("decode_engine_step_ms", {})
    rows = []
    for name, value in tpot.items():
        step = value if name == "engine step" else steps.get(name)
        cells = ("–", "–") if step is None else (f"{step:.2f}", f"{value - step:.2f}")
        rows.append([name, f"{value:.2f}", f"{value / tpot['engine loop'] - 1:+.1%}", *cells])
    out = [
        f"`python -m perf.orchestration_cost` (run {orchestration.get('finished', 'earlier')}; "
        f"{orchestration['tokens']} tokens, {orchestration.get('dtype', 'bfloat16')}, median of "
        f"{orchestration['reps']} interleaved repetitions): TPOT through `ensemble` and `llm` beside the "
        "decode pool's engine loop without Triton, and the decode engine's own time per step in each case "
        "(in-process counters; inside the server, its `disagg_engine_busy_seconds_total` / "
        "`disagg_engine_steps_total`).",
        "",
        *_table(["path", "TPOT (ms)", "vs engine loop", "decode engine step (ms)", "TPOT − step (ms)"], rows),
        "",
    ]
    loop_step = steps.get("engine loop")
    for name in ("ensemble", "llm"):
        if name in steps and loop_step:
            slower, between = steps[name] - loop_step, tpot[name] - steps[name]
            gap = tpot[name] - tpot["engine loop"]
            out.append(
                f"- `{name}`: {gap:+.2f} ms per token over the engine loop; the decode engine step itself "
                f"is {slower:+.2f} ms slower inside the server, and {between:.2f} ms pass between steps "
                f"(engine loop: {tpot['engine loop'] - loop_step:.2f} ms)."
            )
    both = orchestration.get("colocated")
    if both:
        inside = both.get("server_step_ms")
        out += [
            "",
            "The colocated pool, measured after them the same way: its engine's step alone on both cores "
            "(two threads, one process), and through `ensemble_colocated`, whose pool shares those cores "
            "with the token relay.",
            "",
            *_table(
                ["path", "TPOT (ms)", "colocated engine step (ms)", "step inside / alone"],
                [
                    [
                        "engine step, both cores",
                        f"{both['engine_step_ms']:.2f}",
                        f"{both['engine_step_ms']:.2f}",
                        "1.00",
                    ],
                    [
                        "ensemble_colocated",
                        f"{both['tpot_ms']:.2f}",
                        "–" if inside is None else f"{inside:.2f}",
                        "–" if inside is None else f"{inside / both['engine_step_ms']:.2f}",
                    ],
                ],
            ),
        ]
    return [*out, ""]


def render(
    results: dict[str, Any], plots: dict[str, list[str]], orchestration: dict[str, Any] | None = None
) -> str:
    """Markdown for `results` (the JSON of `perf/run_all.py`); `plots` maps a section
    ("attainment", "cdf", "interference") to image paths relative to the report; `orchestration` is
    the JSON of `perf/orchestration_cost.py`, when there is one."""
    meta = results["meta"]
    out = [
        "# Serving benchmark: disaggregated vs colocated vs vLLM CPU vs llama.cpp",
        "",
        f"Generated by `{meta['command']}` on {meta['finished']} ({meta['mode']} run, "
        f"{meta['elapsed_s'] / 60:.1f} min). Machine: {meta['machine']}. Model: `{meta['model']}`.",
        "",
        UNIQUE_PROMPTS_NOTE,
        "",
        "Load: open-loop Poisson arrivals (seeded; a slow server never slows the sender, and the scheduled "
        "arrival is the TTFT origin). TTFT = first token − arrival; TPOT = (last − first)/(n − 1); "
        f"attainment = share of requests meeting both SLOs; goodput = the highest rate with attainment ≥ "
        f"{results['target_attainment'] * 100:.0f} % (bisection on the rate). "
        f"Output tokens counted: {meta['token_counting']}. The load generator ran on CPUs "
        f"{meta.get('loadgen_affinity')}, sharing the cores with the deployments.",
        "",
    ]
    for note in meta.get("notes", []):
        out.append(f"> {note}")
        out.append("")

    out += _targets(results, orchestration)
    out += _freshness(results)
    out += ["## Deployments", ""]
    rows = []
    for name, dep in results["deployments"].items():
        status = "measured" if dep["available"] else f"not measured: {dep['reason']}"
        rows.append([name, f"`{dep['endpoint']}`", str(dep["cores"]), dep["note"], status])
    out += _table(["deployment", "endpoint", "cores", "setup", "status"], rows)
    out.append("")

    out += ["## SLOs (fixed by rule, frozen)", "", results["slo_rule"], ""]
    rows = []
    for workload, cal in results["calibrations"].items():
        frozen = cal.get("frozen")
        source = "derived in this run"
        if cal.get("fixed"):
            source = f"given: {cal['fixed']}"
        elif frozen:
            idle = f"{_ms(frozen['idle_ttft_s'])} / {_ms(frozen['idle_tpot_s'])}"
            source = f"frozen {frozen['derived'][:10]} (idle then {idle})"
        rows.append([
            workload, str(cal["prompt_tokens"]), cal["reference"], _ms(cal["idle_ttft_s"]),
            _ms(cal["idle_tpot_s"]), f"**{_ms(cal['slo']['ttft_s'])}**", f"**{_ms(cal['slo']['tpot_s'])}**",
            source,
        ])  # fmt: skip
    out += _table(
        ["workload", "median prompt (tokens)", "reference", "idle TTFT today (ms)", "idle TPOT today (ms)",
         "TTFT SLO (ms)", "TPOT SLO (ms)", "SLO from"],
        rows,
    )  # fmt: skip
    out.append("")

    for kind, title in (
        ("colocated", "Our colocated baseline"),
        ("disagg", "Our disaggregated deployment"),
        ("vllm", "vLLM"),
        ("llamacpp", "llama.cpp's server"),
    ):
        out += _grid_section(results, kind, title)
    for kind, title in (("vllm", "vLLM"), ("llamacpp", "llama.cpp's server")):
        grid = results.get(f"{kind}_grid")
        if grid and grid.get("command"):
            out += [f"{title} as measured: `{grid['command']}`", ""]
    build = results.get("llamacpp_build")
    if build:
        on = [k.removeprefix("GGML_") for k, v in build.get("options", {}).items() if v == "ON"]
        out += [
            f"llama.cpp's server was built from `{build.get('sdist')}` with {', '.join(on) or 'none'} "
            f"(GGML_NATIVE off); it reports: `{build.get('system_info') or '(none)'}`."
            + (f" {build['note']}." if build.get("note") else ""),
            "",
        ]
    if results.get("vllm_pd", {}).get("command"):
        out += [f"vLLM P/D as measured (prefill ; decode ; proxy): `{results['vllm_pd']['command']}`", ""]

    out += [
        "## Goodput",
        "",
        "Alone: the median TTFT / TPOT of three requests of the workload's median prompt length, each "
        "served alone, measured just before the deployment's search. A deployment that misses an SLO "
        "alone cannot reach the target attainment at any rate: its goodput is 0, not searched.",
        "",
    ]
    for workload, per_dep in results.get("goodput", {}).items():
        cal = results["calibrations"].get(workload, {}).get("slo")
        bar = f" (SLOs {_ms(cal['ttft_s'])} ms / {_ms(cal['tpot_s'])} ms)" if cal else ""
        out += [f"### {workload}{bar}", ""]
        coloc = per_dep.get("colocated", {}).get("goodput_rps")
        alone = results.get("alone", {}).get(workload, {})
        ours = Bracket.of(per_dep[OURS]) if OURS in per_dep else None
        rows = []
        for name, res in per_dep.items():
            best = res["goodput_rps"]
            at = [p for p in res["probes"] if p["rate"] == best]
            s = at[0]["summary"] if at else {}
            shown = f"**{_rate(best)}**" + (" (misses alone)" if res.get("misses_alone") else "")
            bracket = Bracket.of(res)
            width = f" ({bracket.width:.1%})" if bracket.width is not None else ""
            stop = res.get("stop_reason") or ("misses alone" if res.get("misses_alone") else "–")
            against = "–" if ours is None or name == OURS else _against(ours, bracket)
            rows.append([
                name, shown, f"{bracket.text()}{width}", stop, against, _ratio(best, coloc),
                _alone(alone.get(name)), _ms(s.get("ttft_p90")), _ms(s.get("tpot_p90")),
                str(len(res["probes"])), _fresh(res),
            ])  # fmt: skip
        out += _table(
            ["deployment", "goodput (req/s, machine)", "bracket (req/s)", "search stopped", "disagg vs it",
             "vs colocated", "alone: TTFT / TPOT (ms)", "TTFT p90 at goodput (ms)",
             "TPOT p90 at goodput (ms)", "probes", "measured"],
            rows,
        )  # fmt: skip
        out.append("")
    out += _prompt_bound(results)
    for path in plots.get("attainment", []) + plots.get("cdf", []):
        out += [f"![{path}]({path})", ""]

    out += ["## Interference (short-request TPOT, decode-only vs 20 % long prompts)", ""]
    rows = []
    for name, res in results.get("interference", {}).items():
        per_seed = ", ".join(
            f"{e['seed']}: {e['ratio_p99']:.2f}×" if e.get("ratio_p99") else f"{e['seed']}: –"
            for e in res.get("per_seed", [])
        )
        rows.append([
            name, f"{res['rate']:.2f}", str(res["count"]), str(len(res.get("seeds", [1]))),
            _ms(res["decode_only_tpot_p50"]), _ms(res["decode_only_tpot_p99"]), _ms(res["mixed_tpot_p50"]),
            _ms(res["mixed_tpot_p99"]), _ratio(res["mixed_tpot_p50"], res["decode_only_tpot_p50"]),
            f"**{_ratio(res['mixed_tpot_p99'], res['decode_only_tpot_p99'])}**", per_seed or "–", _fresh(res),
        ])  # fmt: skip
    out += _table(
        ["deployment", "rate (req/s)", "requests/run", "seeds", "decode-only p50 (ms)",
         "decode-only p99 (ms)", "mixed p50 (ms)", "mixed p99 (ms)", "ratio p50 (pooled)",
         "ratio p99 (pooled)", "ratio p99 per seed", "measured"],
        rows,
    )  # fmt: skip
    out.append("")
    if results.get("interference"):
        any_res = next(iter(results["interference"].values()))
        out += [
            f"Short requests: 10-token prompts, 64 output tokens. Mixed run: the same arrivals with "
            f"{any_res['long_share'] * 100:.0f} % of requests carrying unique {any_res['long_prompt_tokens']}"
            "-token prompts instead. Each seed is a fresh pair of runs (its own arrivals and prompts); the "
            f"pooled ratios are over every seed's short requests. Target: disaggregated p99 ratio ≤ "
            f"{INTERFERENCE_TARGET:g}×.",
            "",
        ]
    for path in plots.get("interference", []):
        out += [f"![{path}]({path})", ""]
    out += _placement(results.get("interference", {}))
    if orchestration:
        out += ["", "## Orchestration cost (one stream, low load)", "", *orchestration_section(orchestration)]
    return "\n".join(out).rstrip() + "\n"


def section_markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: start -->", f"<!-- {name}: end -->"


def publish(report: str, out: Path, results: Path | None, section: str) -> None:
    """A benchmark's markdown `report` written to `out`, and, with its title one level down, to its
    `section` of `results` (perf/RESULTS.md) when that file exists; then printed."""
    from perf.benchlib.cliutil import log

    out.write_text(report)
    if results is not None and results.is_file():
        body = report.replace("# ", "## ", 1) if report.startswith("# ") else report
        results.write_text(with_section(results.read_text(), section, body))
    log(report)


def with_section(report: str, name: str, body: str) -> str:
    """`report` with its section `name` (between its markers) replaced by `body`, or `body` appended:
    how a benchmark of its own keeps its part of perf/RESULTS.md current."""
    first, last = section_markers(name)
    section = f"{first}\n{body.rstrip()}\n{last}\n"
    start, end = report.find(first), report.find(last)
    if start >= 0 and end > start:
        rest = report[end + len(last) :]
        return report[:start] + section + (rest[1:] if rest.startswith("\n") else rest)
    return report.rstrip("\n") + "\n\n" + section


_SECTION_RE = re.compile(r"<!-- ([\w-]+): start -->\n(.*?)\n<!-- \1: end -->", re.S)


def sections(report: str) -> dict[str, str]:
    """The marked sections of `report` (name -> body), in order."""
    return {m.group(1): m.group(2) for m in _SECTION_RE.finditer(report)}


def keeping_sections(new: str, old: str) -> str:
    """`new` (a freshly rendered report) with every marked section of `old` kept: the sections other
    benchmarks keep in perf/RESULTS.md survive a run of perf/run_all.py."""
    for name, body in sections(old).items():
        new = with_section(new, name, body)
    return new
