"""PNG plots of a results dict (the JSON written by `perf/run_all.py`), with matplotlib's Agg backend.

Each function takes the results dict and an output folder and returns the paths it wrote; a section with
no data is skipped rather than drawn empty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on benchmark machines
import matplotlib.pyplot as plt

COLOURS = {"disagg": "tab:green", "llm": "tab:olive", "colocated": "tab:blue", "vllm": "tab:red"}


def _colour(name: str) -> str | None:
    return COLOURS.get(name)


def attainment_plots(results: dict[str, Any], out: Path) -> list[Path]:
    """One PNG per workload: SLO attainment vs arrival rate, one line per deployment."""
    paths = []
    for workload, per_dep in results.get("goodput", {}).items():
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
        for name, res in per_dep.items():
            probes = sorted((p["rate"], p["summary"]["attainment"]) for p in res["probes"])
            if not probes:
                continue
            rates, att = zip(*probes, strict=True)
            ax.plot(rates, [a * 100 for a in att], "o-", color=_colour(name), label=name)
            if res["goodput_rps"] > 0:
                ax.axvline(res["goodput_rps"], color=_colour(name), ls=":", lw=1)
        target = results.get("target_attainment", 0.9) * 100
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.0f} %")
        ax.set(
            xlabel="arrival rate (requests/s, Poisson)",
            ylabel="SLO attainment (%)",
            ylim=(-3, 103),
            title=f"{workload}: attainment vs rate (dotted: goodput)",
        )
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left")
        fig.tight_layout()
        path = out / f"attainment_{workload}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def _cdf(ax: Any, values: list[float], **kwargs: Any) -> None:
    data = sorted(v * 1000 for v in values)
    if data:
        ax.step(data, [(i + 1) / len(data) for i in range(len(data))], where="post", **kwargs)


def cdf_plots(results: dict[str, Any], records: dict[str, Any], out: Path) -> list[Path]:
    """One PNG per workload: TTFT and TPOT CDFs of each deployment's run at its goodput rate (the highest
    passing probe), with the SLOs as vertical lines."""
    paths = []
    for workload, per_dep in records.get("goodput", {}).items():
        calibration = results["calibrations"].get(workload)
        if calibration is None:  # an earlier run's workload this run did not measure (--keep-earlier)
            continue
        slo = calibration["slo"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
        drawn = False
        for name, run in per_dep.items():
            if run is None:
                continue
            label = f"{name} @ {run['rate']:.2f}/s"
            ok = [r for r in run["records"] if r["error"] is None]
            _cdf(left, [r["ttft"] for r in ok if r["ttft"] is not None], color=_colour(name), label=label)
            _cdf(right, [r["tpot"] for r in ok if r["tpot"] is not None], color=_colour(name), label=label)
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        left.axvline(slo["ttft_s"] * 1000, color="grey", ls="--", lw=1, label="TTFT SLO")
        right.axvline(slo["tpot_s"] * 1000, color="grey", ls="--", lw=1, label="TPOT SLO")
        left.set_xlim(left=0)
        right.set_xlim(left=0)
        left.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title=f"{workload}: TTFT CDF")
        right.set(xlabel="TPOT (ms)", title=f"{workload}: TPOT CDF")
        for ax in (left, right):
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        path = out / f"cdf_{workload}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def interference_plot(results: dict[str, Any], out: Path) -> list[Path]:
    """Grouped bars: short-request TPOT p50 and p99, decode-only vs mixed, per deployment."""
    runs = {name: r for name, r in results.get("interference", {}).items() if r.get("ratio_p99") is not None}
    if not runs:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=120, sharey=True)
    width = 0.38
    for ax, q in zip(axes, ("p50", "p99"), strict=True):
        names = list(runs)
        xs = range(len(names))
        base = [runs[n][f"decode_only_tpot_{q}"] * 1000 for n in names]
        mixed = [runs[n][f"mixed_tpot_{q}"] * 1000 for n in names]
        ax.bar([x - width / 2 for x in xs], base, width, label="decode-only", color="tab:gray")
        bars = ax.bar(
            [x + width / 2 for x in xs], mixed, width, label="20 % long prompts", color="tab:orange"
        )
        for bar, name in zip(bars, names, strict=True):
            ax.annotate(
                f"x{runs[name][f'ratio_{q}']:.2f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=9,
            )
        ax.set_xticks(list(xs), names)
        ax.set(title=f"short-request TPOT {q}", ylabel="TPOT (ms)" if q == "p50" else None)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Interference: decode-only vs mixed with long prompts (label: mixed / decode-only)")
    fig.tight_layout()
    path = out / "interference.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]
