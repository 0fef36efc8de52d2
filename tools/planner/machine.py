"""Machines the planner has never run on: a description of GPUs and their links, a model's shape, and
the step times an instance of ``tp`` GPUs would take, derived from them (a roofline, not a
measurement). Every figure this module gives is a **prediction**: it has not run on such a machine.

The step-time model, per instance of ``tp`` GPUs in tensor parallelism (weights split ``tp`` ways, two
all-reduces of the activations per layer over the GPUs' link):

- prefill of prompts T_i: one read of the weights, ``2 x params x sum(T)`` flops of the projections
  and ``2 x layers x heads x head_dim x sum(T_i^2)`` of causal attention at ``prefill_mfu`` of the
  GPUs' peak, and the all-reduces: ``2 x layers`` of ``sum(T) x hidden x bytes`` moving
  ``2 (tp - 1) / tp`` of their size over the link, each with a fixed ``allreduce_latency_s``;
- a decode step of B sequences holding C tokens: one read of the weights and of the C tokens' KV at
  ``bandwidth_efficiency`` of the HBM bandwidth, ``2 x params x B`` flops at ``decode_mfu``, and the
  all-reduces as above for B tokens.

These map exactly onto the fitted forms of ``planner.profile`` (``a + b T + c sum T^2`` and
``d + e B + f C``), so the simulator runs them as it runs a measured profile. What they leave out:
kernel launch overheads beyond the all-reduce latency, the scheduler's own time, MoE, pipeline
parallelism, and a compute-bound decode at very large batches (the model adds compute to the weight
read instead of taking the larger of the two, so it errs on the slow side).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg.config import build
from disagg_tools.planner.profile import Fit, Profile
from disagg_tools.planner.simulator import Deployment


@dataclass(frozen=True)
class Gpu:
    name: str = "A100-SXM4-80GB"
    peak_tflops: float = 312.0  # dense bf16 tensor-core peak
    hbm_gbps: float = 2039.0
    memory_gb: float = 80.0


@dataclass(frozen=True)
class Links:
    tp_gbps: float = 600.0  # between the GPUs of a tensor-parallel group (NVLink 3.0)
    kv_gbps: float = 600.0  # of the KV hand-off from a prefill to a decode instance
    kv_fixed_s: float = 0.0005  # the hand-off's cost apart from its bytes
    allreduce_latency_s: float = 10e-6


@dataclass(frozen=True)
class Efficiency:
    prefill_mfu: float = 0.5  # share of the peak a prefill's matrix multiplies reach
    decode_mfu: float = 0.3
    bandwidth_efficiency: float = 0.7  # share of the HBM bandwidth a decode step's reads reach
    memory_reserve: float = 0.1  # of each GPU's memory, kept for activations and the runtime


@dataclass(frozen=True)
class ModelShape:
    """A dense llama-style decoder: what the step times and the memory depend on."""

    name: str = "llama-13b"
    layers: int = 40
    hidden: int = 5120
    heads: int = 40
    kv_heads: int = 40
    head_dim: int = 128
    ffn: int = 13824
    vocab: int = 32000
    dtype_bytes: int = 2

    @property
    def params(self) -> float:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.ffn
        return self.layers * (attention + mlp) + 2 * self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Machine:
    """``nodes`` nodes of ``gpus_per_node`` GPUs. A tensor-parallel group stays within a node."""

    name: str = "8xA100"
    nodes: int = 1
    gpus_per_node: int = 8
    gpu: Gpu = field(default_factory=Gpu)
    links: Links = field(default_factory=Links)
    efficiency: Efficiency = field(default_factory=Efficiency)
    model: ModelShape = field(default_factory=ModelShape)
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("nodes and gpus_per_node must be at least 1")
        if not self.tp_sizes or any(t < 1 or t > self.gpus_per_node for t in self.tp_sizes):
            raise ValueError(f"tp_sizes must be in 1..gpus_per_node ({self.gpus_per_node})")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def fits(self, tp: int) -> bool:
        """Whether the weights, split ``tp`` ways, leave room for KV in each GPU's memory."""
        usable = self.gpu.memory_gb * 1e9 * (1 - self.efficiency.memory_reserve)
        return self.model.params * self.model.dtype_bytes / tp < 0.8 * usable

    def profile(self, tp: int) -> Profile:
        """The predicted step times of one instance of ``tp`` GPUs (see the module docstring)."""
        m, g, link, eff = self.model, self.gpu, self.links, self.efficiency
        weights = m.params * m.dtype_bytes / tp
        read = weights / (g.hbm_gbps * 1e9 * eff.bandwidth_efficiency)
        flops = g.peak_tflops * 1e12 * tp
        comm_per_token = 0.0
        latency = 0.0
        if tp > 1:
            per_token = m.hidden * m.dtype_bytes * 2 * (tp - 1) / tp
            comm_per_token = 2 * m.layers * per_token / (link.tp_gbps * 1e9)
            latency = 2 * m.layers * link.allreduce_latency_s
        prefill = Fit(
            (
                read + latency,
                2 * m.params / (flops * eff.prefill_mfu) + comm_per_token,
                2 * m.layers * m.heads * m.head_dim / (flops * eff.prefill_mfu),
            ),
            0.0,
            0.0,
        )
        decode = Fit(
            (
                read + latency,
                2 * m.params / (flops * eff.decode_mfu) + comm_per_token,
                m.kv_bytes_per_token / tp / (g.hbm_gbps * 1e9 * eff.bandwidth_efficiency),
            ),
            0.0,
            0.0,
        )
        return Profile(
            prefill,
            decode,
            model=f"{m.name} on {tp}x {g.name} (predicted)",
            dtype=f"{8 * m.dtype_bytes}-bit",
            kv_bytes_per_token=m.kv_bytes_per_token,
        )

    def max_batch(self, tp: int, context: int) -> int:
        """Sequences of ``context`` tokens whose KV fits beside the weights of a ``tp``-GPU instance."""
        usable = self.gpu.memory_gb * 1e9 * (1 - self.efficiency.memory_reserve) * tp
        free = usable - self.model.params * self.model.dtype_bytes
        return max(0, int(free // (context * self.model.kv_bytes_per_token)))


def load_machine(path: Path) -> Machine:
    """A machine description (YAML), built and validated as every config is (errors name the key)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: a machine description is a mapping")
    return build(Machine, dict(data))


def gpu_placements(machine: Machine, context: int) -> list[tuple[str, Deployment, int]]:
    """(name, deployment, GPUs used) of every placement that uses all the machine's GPUs: P prefill
    instances of tp_p GPUs and D decode instances of tp_d GPUs with P x tp_p + D x tp_d = the GPUs,
    and colocated instances of tp GPUs filling it. Sizes whose weights do not fit a GPU group are left
    out (a GPU left idle is never better per GPU)."""
    out: list[tuple[str, Deployment, int]] = []
    links = machine.links
    sizes = [t for t in machine.tp_sizes if machine.fits(t)]
    for tp_p, tp_d in itertools.product(sizes, sizes):
        for p in range(1, machine.gpus // tp_p + 1):
            left = machine.gpus - p * tp_p
            d = left // tp_d
            if d < 1 or d * tp_d != left:
                continue
            deployment = Deployment(
                prefill=(machine.profile(tp_p),) * p,
                decode=(machine.profile(tp_d),) * d,
                max_batch=max(1, machine.max_batch(tp_d, context)),
                transfer_bytes_per_s=links.kv_gbps * 1e9,
                transfer_fixed_s=links.kv_fixed_s,
            )
            out.append((f"prefill {p}x TP{tp_p} : decode {d}x TP{tp_d}", deployment, p * tp_p + d * tp_d))
    for tp in sizes:
        n = machine.gpus // tp
        colocated = Deployment(
            colocated=(machine.profile(tp),) * n, max_batch=max(1, machine.max_batch(tp, context))
        )
        out.append((f"colocated {n}x TP{tp}", colocated, n * tp))
    return out


def describe(machine: Machine) -> dict[str, Any]:
    m = machine.model
    return {
        "machine": machine.name,
        "gpus": machine.gpus,
        "model": m.name,
        "params_b": round(m.params / 1e9, 2),
        "kv_kb_per_token": round(m.kv_bytes_per_token / 1024, 1),
        "tp_that_fit": [t for t in machine.tp_sizes if machine.fits(t)],
    }
