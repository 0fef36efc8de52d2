"""Our disaggregated deployment at its best: conditional disaggregation off and on, with the
repository's core loans or none, each on a repository of its own that carries what `disagg repository
--set pools.decode.conditional.prefill_tokens=N` (`pools.prefill.borrow`, `pools.decode.lend_tpot_s`)
writes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_bench_vllm_grid import args_for

from disagg_tools.repository import Layout, write
from perf import run_all

REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"


def parameters(repository: Path) -> dict[str, dict[str, str]]:
    """Every model's parameters, by model."""
    entry = re.compile(r'\{ key: "([^"]+)", value: \{ string_value: "([^"]*)" \} \}')
    return {
        config.parent.name: dict(entry.findall(config.read_text()))
        for config in sorted(repository.glob("*/config.pbtxt"))
    }


def test_the_default_grid_is_off_512_tokens_and_off_without_loans(tmp_path: Path) -> None:
    grid = run_all.disagg_grid(args_for(tmp_path).disagg_grid)
    assert grid == [run_all.DisaggChoice(0), run_all.DisaggChoice(512), run_all.DisaggChoice(0, static=True)]
    assert grid[0].label == "conditional disaggregation off, core loans as the repository has them"
    assert grid[1].label == (
        "conditional disaggregation, prompts up to 512 tokens on the decode pool in chunks of 128, core "
        "loans as the repository has them"
    )
    assert grid[2].label == "conditional disaggregation off, static pools (no core loans)"
    assert run_all.disagg_grid("0+lend30") == [run_all.DisaggChoice(0, lend_tpot_ms=30)]


@pytest.mark.parametrize("text", ["", "off", "0,-1", "70000", " , ", "0+lend0", "0+lend30+static", "0+lendx"])
def test_a_malformed_grid_is_refused(text: str) -> None:
    with pytest.raises(SystemExit, match="disagg-grid"):
        run_all.disagg_grid(text)


def test_off_is_the_repository_itself(tmp_path: Path) -> None:
    assert run_all.DisaggChoice(0).repository(REPOSITORY, tmp_path) == REPOSITORY
    assert list(tmp_path.iterdir()) == []


def test_on_carries_the_parameters_the_generator_writes(tmp_path: Path) -> None:
    copy = run_all.DisaggChoice(512).repository(REPOSITORY, tmp_path / "grid")
    generated = tmp_path / "generated"
    write(generated, Layout(conditional_prefill_tokens=512))
    assert parameters(copy) == parameters(generated)
    assert parameters(copy) != parameters(REPOSITORY)
    assert parameters(copy)["orchestrator_colocated"] == parameters(REPOSITORY)["orchestrator_colocated"]


def test_loans_and_static_carry_the_parameters_the_generator_writes(tmp_path: Path) -> None:
    lent = run_all.DisaggChoice(0, lend_tpot_ms=30).repository(REPOSITORY, tmp_path / "lent")
    generated = tmp_path / "generated"
    write(generated, Layout(prefill_borrow="1", decode_lend_tpot_s=0.03))
    assert parameters(lent) == parameters(generated)
    static = run_all.DisaggChoice(0, static=True).repository(REPOSITORY, tmp_path / "static")
    assert parameters(static)["prefill"]["borrow"] == "" and parameters(static)["decode"]["lend"] == ""
    assert parameters(REPOSITORY)["prefill"]["borrow"] == "1"  # the default deployment lends
