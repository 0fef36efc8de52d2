"""The GPU machine description and its predicted step times (tools/planner/machine.py), checked by hand
against the roofline they stand for; the placements of a machine; `disagg plan --machine`."""

from __future__ import annotations

import pytest
import yaml

from disagg.config import ConfigError
from disagg.paths import REPO_ROOT
from disagg_tools.planner.cli import plan_main
from disagg_tools.planner.machine import Machine, ModelShape, gpu_placements, load_machine

A100 = REPO_ROOT / "deploy" / "machines" / "8xa100.yaml"


def test_a_one_gpu_step_is_the_weight_read_plus_the_flops_at_their_efficiency():
    machine = Machine()
    m, profile = machine.model, machine.profile(1)
    weights = m.params * 2
    read = weights / (2039e9 * 0.7)
    # a decode step of one sequence holding 1000 tokens: weights + KV read, flops at 30 % of the peak
    expected = read + 2 * m.params / (312e12 * 0.3) + 1000 * m.kv_bytes_per_token / (2039e9 * 0.7)
    assert profile.decode_s(1, 1000) == pytest.approx(expected)
    # a 300-token prefill: the weight read, projections and causal attention at 50 % of the peak
    attention = 2 * m.layers * m.heads * m.head_dim * 300**2
    expected = read + (2 * m.params * 300 + attention) / (312e12 * 0.5)
    assert profile.prefill_s([300]) == pytest.approx(expected)
    assert m.kv_bytes_per_token == 2 * 40 * 40 * 128 * 2


def test_tensor_parallelism_splits_the_work_and_pays_for_its_all_reduces():
    machine = Machine()
    one, four = machine.profile(1), machine.profile(4)
    assert four.prefill_s([2048]) < one.prefill_s([2048]) / 3, "a long prompt gains almost 4x"
    latency = 2 * machine.model.layers * machine.links.allreduce_latency_s
    assert four.decode.coefficients[0] == pytest.approx(one.decode.coefficients[0] / 4 + latency)
    assert four.decode.coefficients[1] > one.decode.coefficients[1] / 4, "each token's activations move"


def test_a_model_too_big_for_one_gpu_is_only_placed_across_several():
    big = Machine(model=ModelShape(name="66b", layers=64, hidden=9216, heads=72, kv_heads=72, ffn=24576))
    assert not big.fits(1) and big.fits(4)
    names = [name for name, _, _ in gpu_placements(big, context=2048)]
    assert names and not any("TP1" in n for n in names)
    for _, deployment, used in gpu_placements(big, context=2048):
        assert used == 8 and deployment.max_batch >= 1


def test_the_committed_8xa100_description_loads_and_its_placements_use_at_most_its_gpus():
    machine = load_machine(A100)
    assert machine.gpus == 8 and machine.model.name == "llama-13b"
    found = gpu_placements(machine, context=2048)
    assert {used for _, _, used in found} == {8}, "placements use every GPU"
    assert any(name.startswith("prefill 1x TP4 : decode 4x TP1") for name, _, _ in found)
    assert any(name.startswith("colocated 8x TP1") for name, _, _ in found)
    # the article's layout: a prefill node of two 4-GPU groups, a decode node of one-GPU instances
    two = load_machine(A100.with_name("2x8xa100.yaml"))
    assert two.gpus == 16 and two.links.kv_gbps == 800
    assert "prefill 2x TP4 : decode 8x TP1" in [name for name, _, _ in gpu_placements(two, context=2048)]


def test_a_machine_description_error_names_the_key(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text(yaml.safe_dump({"gpu": {"peak_tflops": "fast"}}))
    with pytest.raises(ConfigError, match=r"gpu\.peak_tflops"):
        load_machine(bad)
    bad.write_text(yaml.safe_dump({"tp_sizes": [16]}))
    with pytest.raises(ValueError, match="tp_sizes"):
        load_machine(bad)


def test_plan_on_a_machine_prints_predictions_labelled_as_such(tmp_path, capsys):
    small = tmp_path / "2gpu.yaml"
    small.write_text(yaml.safe_dump({"name": "2xA100", "gpus_per_node": 2, "tp_sizes": [1, 2]}))
    argv = ["--machine", str(small), "--prompt", "fixed:300", "--output", "fixed:32"]
    assert plan_main([*argv, "--ttft", "0.5", "--tpot", "0.05", "--requests", "60"]) == 0
    out = capsys.readouterr().out
    assert "PREDICTED" in out and "recommended (predicted, not measured)" in out
    assert "prefill 1x TP1 : decode 1x TP1" in out and "colocated 1x TP2" in out
