"""Engine speed on CPU cores: this engine vs eager transformers, side by side in one run.

Measures prefill tokens/s (one prompt) and decode tokens/s at batch 1, 8 and 32, for
  - transformers (fp32, SDPA attention, eager): the baseline,
  - this engine in fp32 on the fp32 weights through MKL (``native_kernels: false``, the token-exact
    reference configuration),
  - this engine in fp32 as the pools run fp32 (``native_kernels: true``), on a CPU with AVX2: its
    fp32 kernels, reading block-coded weights in its decode rows where the checkpoint's weights are
    Q4_1 / Q8_0 codes,
  - on a CPU whose oneDNN runs bf16 (AVX-512-BF16 or AMX; elsewhere bf16 is emulated and left out):
    this engine in bf16 with plain weights through ``F.linear`` (``native_kernels: false,
    pack_weights: false``), with weights prepacked for oneDNN (``native_kernels: false``), and as the
    pools run it, with its own projection and paged decode attention kernels (decode rows on the
    checkpoint's Q4_1 codes where it holds them; then also on a copy stored in bf16, the same weights
    without codes, for comparison),
  - vLLM CPU's offline engine in bf16 and fp32, when ``.venv-vllm`` is installed (in a process of its
    own, measured on request: ``benchlib/vllm_engine.py``).
Repetitions are interleaved (A B C A B C ..., vLLM among them) so drift on a shared machine hits all
alike; the median of each is reported, and ratios against the baseline from the same run.

    python -m perf.engine_bench [--model DIR ...] [--cores 0[,1]] [--reps R]

Each ``--model`` gets its own table (the tiny model and SmolLM2-135M-Instruct by ``make
bench-engine``), followed by what bounds the decode step of the pools' configuration on this CPU (bf16
with its kernels where oneDNN runs bf16, else fp32 as the pools run it): the time to read the weights
once, in the layout that step reads, at these cores' measured read-only bandwidth, and the output
head's share of the step; and the rate of its prefill's projections (``benchlib/gemmrate.py``: 2 x the
prompt's tokens x the layers' projection weights, plus 2 x the output head's for the last row, over
the prefill's time) beside ``F.linear``'s on one thread on the same GEMMs in the same dtype.

Writes engine_bench.json and engine_bench.md into --out-dir (default perf/results/; `make
bench-engine` uses perf/results/engine_1core and perf/results/engine_2core).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from disagg.engine.checkpoint import ModelConfig
from disagg.engine.device import onednn_bf16
from disagg.engine.engine import Engine, EngineConfig
from disagg.engine.params import SamplingParams
from disagg.engine.sequence import Request
from disagg.paths import resolve_model_dir
from disagg_tools.checkpoints import ensure_model
from perf.benchlib.gemmrate import prompt_flops, reference_seconds
from perf.benchlib.outputs import write_results
from perf.benchlib.timing import median_time

RESULTS = Path(__file__).resolve().parent / "results"
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
VLLM_SCRIPT = Path(__file__).resolve().parent / "benchlib" / "vllm_engine.py"


class HFRunner:
    """Eager transformers, greedy, with its own KV cache: how a plain PyTorch user would run."""

    def __init__(self, model_dir: Path, device: str = "cpu", dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        self.dtype = dtype
        self.device = torch.device(device)
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
        self.name = f"transformers {short} (sdpa)"
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
            )
            .to(self.device)
            .eval()
        )

    def _sync(self) -> None:
        if self.device.type == "cuda":  # the tokens stay on the GPU: wait for the kernels
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> None:
        self.model(input_ids=torch.tensor([prompt], device=self.device), use_cache=True, logits_to_keep=1)
        self._sync()

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], steps: int) -> float:
        out = self.model(
            input_ids=torch.tensor(prompts, device=self.device), use_cache=True, logits_to_keep=1
        )
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        self._sync()
        start = time.perf_counter()
        for _ in range(steps):
            out = self.model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        self._sync()
        return time.perf_counter() - start


class HFStaticRunner(HFRunner):
    """transformers' own fast path: its static KV cache, through ``generate``, which compiles the
    model's forward itself where a static cache allows it (on a GPU; ``compiled`` says whether
    torch.compile ran). A decode step's time is ``generate`` of ``steps + 1`` new tokens less
    ``generate`` of one, over ``steps`` (the prompt's prefill and the first token cancel out); the
    same cache object per batch size, reset each call, so the compiled graphs see fixed shapes.
    Prefill is the eager one of ``HFRunner`` (the static path compiles decoding only)."""

    def __init__(self, model_dir: Path, device: str = "cpu", dtype: str = "float32") -> None:
        super().__init__(model_dir, device, dtype)
        self.name = self.name.replace("(sdpa)", "(static cache, generate)")
        self._caches: dict[tuple[int, int], object] = {}
        self.compiled = False

    def _cache(self, batch: int, length: int) -> object:
        """A static cache for ``batch`` rows of ``length`` tokens (its constructor's arguments differ
        between transformers releases: those it takes are given)."""
        import inspect

        from transformers import StaticCache

        key = (batch, length)
        if key not in self._caches:
            offered = {
                "config": self.model.config,
                "max_cache_len": length,
                "max_batch_size": batch,
                "batch_size": batch,
                "device": self.device,
                "dtype": getattr(torch, self.dtype),
            }
            taken = inspect.signature(StaticCache.__init__).parameters
            kwargs = {k: v for k, v in offered.items() if k in taken}
            self._caches[key] = StaticCache(**kwargs)
        return self._caches[key]

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], steps: int) -> float:
        ids = torch.tensor(prompts, device=self.device)
        cache = self._cache(len(prompts), ids.shape[1] + steps + 1)

        def generate(new: int) -> tuple[float, torch.Tensor]:
            cache.reset()  # type: ignore[attr-defined]
            self._sync()
            start = time.perf_counter()
            with warnings.catch_warnings():  # 5.x names it `cache`; older releases know only this name
                warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)
                out = self.model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                    max_new_tokens=new, min_new_tokens=new, do_sample=False,
                )  # fmt: skip
            self._sync()
            return time.perf_counter() - start, out

        graphs = _dynamo_graphs()
        whole, out = generate(steps + 1)
        first, _ = generate(1)
        self.compiled = self.compiled or _dynamo_graphs() > graphs
        if out.shape[1] != ids.shape[1] + steps + 1:
            raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} tokens, not {steps + 1}")
        return max(whole - first, 0.0)


def _dynamo_graphs() -> int:
    """Graphs torch.compile has made in this process so far (0 where its counters are absent)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


class EngineRunner:
    """This engine; ``pack`` / ``kernel``: EngineConfig's ``pack_weights`` / ``native_kernels``;
    ``graphs``: its ``cuda_graphs`` (a CUDA device only)."""

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        pack: bool = True,
        kernel: bool = True,
        device: str = "cpu",
        graphs: bool = False,
    ) -> None:
        self.dtype = dtype
        self.name = f"disagg engine {dtype}"
        if dtype != "float32" and not pack:
            self.name += ", plain weights"
        elif dtype != "float32" and not kernel:
            self.name += ", oneDNN-packed"
        config = EngineConfig(
            model_dir=model_dir,
            device=device,
            dtype=dtype,
            kv_cache_mb=1024,
            pack_weights=pack,
            native_kernels=kernel,
            cuda_graphs=graphs,
        )
        self.engine = Engine(config)
        if graphs:
            self.name += ", CUDA graphs"
        projections = self.engine.describe()["projections"]
        if "blocks" in projections:
            self.name += ", block codes"
        elif dtype == "float32" and projections == "fp32-kernel":
            self.name += ", fp32 kernels"

    def prefill(self, prompt: list[int]) -> None:
        (out,) = self.engine.prefill([Request(tuple(prompt), SamplingParams(max_tokens=1))], decode=False)
        self.engine.free(out.seq_id)

    def decode(self, prompts: list[list[int]], steps: int) -> float:
        params = SamplingParams(max_tokens=steps + 1)
        outs = self.engine.prefill([Request(tuple(p), params) for p in prompts])
        start = time.perf_counter()
        for _ in range(steps):
            self.engine.decode_step()
        elapsed = time.perf_counter() - start
        for out in outs:
            self.engine.free(out.seq_id)
        return elapsed


def _stored_bf16(model_dir: Path, scratch: Path) -> Path:
    """A copy of ``model_dir`` in ``scratch`` with its tensors stored in bf16: the same weights as a
    bf16 pool computes with, where no block code can be found (the comparison for a coded model)."""
    out = scratch / model_dir.name
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for file in model_dir.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({name: t.bfloat16().contiguous() for name, t in tensors.items()}, out / file.name)
    return out


def _bind(cores: tuple[int, ...]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``cores``: a range when they are contiguous."""
    ordered = sorted(cores)
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}" if len(ordered) > 1 else str(ordered[0])
    return ",".join(str(c) for c in ordered)


class VllmRunner:
    """vLLM's offline engine on the same cores, dtype and model (``benchlib/vllm_engine.py``, in its
    own process and venv), its KV space the same 1 GiB as ours, measured on request so that its
    repetitions interleave with ours. Its prompts are its own, unique, of the same lengths."""

    def __init__(
        self, model_dir: Path, dtype: str, cores: tuple[int, ...], prompt_len: int, context: int, steps: int
    ) -> None:
        self.name, self.dtype = f"vLLM CPU {dtype}", dtype
        self.prompt_len, self.context, self.steps = prompt_len, context, steps
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": _bind(cores),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        read, write = os.pipe()
        command = [str(VLLM_PYTHON), str(VLLM_SCRIPT), "--model", str(model_dir), "--dtype", dtype]
        command += ["--prompt-tokens", str(prompt_len), "--context", str(context), "--steps", str(steps)]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close(), with the process)
        self.process = subprocess.Popen(
            [*command, "--reply-fd", str(write)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            pass_fds=(write,),
        )
        os.close(write)
        self.replies = os.fdopen(read)

    def _ask(self, command: str) -> float:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        reply = self.replies.readline()
        if not reply:
            self.log.seek(0)
            tail = self.log.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"vLLM run failed ({self.process.wait()}): {tail}")
        return float(json.loads(reply)["seconds"])

    def prefill(self, prompt: list[int]) -> float:
        if len(prompt) != self.prompt_len:
            raise ValueError(f"vLLM's runner was started for {self.prompt_len}-token prompts")
        return self._ask("prefill")

    def decode(self, prompts: list[list[int]], steps: int) -> float:
        if len(prompts[0]) != self.context or steps != self.steps:
            raise ValueError(
                f"vLLM's runner was started for a {self.context}-token context, {self.steps} steps"
            )
        return self._ask(f"decode {len(prompts)}")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()
        self.replies.close()
        self.log.close()


def _interleaved(runners: list, measure: Callable[[object], float], reps: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {r.name: [] for r in runners}
    measure(runners[0])  # warm-up of allocator and kernels, once per runner below
    for runner in runners[1:]:
        measure(runner)
    for _ in range(reps):
        for runner in runners:
            samples[runner.name].append(measure(runner))
    return {name: statistics.median(values) for name, values in samples.items()}


def measure(
    runners: list, tokens: Callable[[int], list[int]], prompt_len: int, context: int, steps: int, reps: int
) -> list[dict]:
    """Rows of seconds per runner, repetitions interleaved: prefill of one ``prompt_len``-token prompt,
    then ``steps`` decode steps at batch 1, 8 and 32 from ``context``-token prompts (``tokens(n)``
    draws a prompt of n tokens)."""
    dtypes = {r.name: r.dtype for r in runners}
    prompt = tokens(prompt_len)

    def time_prefill(runner) -> float:
        start = time.perf_counter()
        measured = runner.prefill(prompt)  # vLLM's runner times its own call, without the pipe
        return measured if measured is not None else time.perf_counter() - start

    rows = [
        dict(phase="prefill", runner=name, batch=1, tokens=prompt_len, seconds=sec, dtype=dtypes[name])
        for name, sec in _interleaved(runners, time_prefill, reps).items()
    ]
    for batch in (1, 8, 32):
        prompts = [tokens(context) for _ in range(batch)]
        seconds = _interleaved(runners, lambda r, p=prompts: r.decode(p, steps), reps)
        rows += [
            dict(
                phase="decode",
                runner=name,
                batch=batch,
                tokens=batch * steps,
                seconds=sec,
                dtype=dtypes[name],
            )
            for name, sec in seconds.items()
        ]
    return rows


def run(
    model_dir: Path,
    cores: tuple[int, ...],
    reps: int,
    prompt_len: int,
    context: int,
    steps: int,
    vllm_dtypes: tuple[str, ...] = (),
) -> dict:
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return [1, *torch.randint(3, 1000, (n - 1,), generator=gen).tolist()]

    runners = [HFRunner(model_dir), EngineRunner(model_dir, "float32", kernel=False)]
    pools = EngineRunner(model_dir, "float32")  # fp32 as the pools run it: the engine's kernels, if any
    if pools.engine.describe()["projections"] != "torch":
        runners.append(pools)
    del pools
    scratch = tempfile.TemporaryDirectory(prefix="engine-bench-")
    if onednn_bf16():  # elsewhere bf16 is emulated, many times slower than fp32: not a pool's choice
        runners += [
            EngineRunner(model_dir, "bfloat16", pack=False, kernel=False),
            EngineRunner(model_dir, "bfloat16", kernel=False),
        ]
        bf16_pools = EngineRunner(model_dir, "bfloat16")
        if "blocks" in bf16_pools.engine.describe()["projections"]:  # beside it: the same without codes
            rounded = EngineRunner(_stored_bf16(model_dir, Path(scratch.name)), "bfloat16")
            rounded.name += ", bf16 weights (no codes)"
            runners.append(rounded)
        runners.append(bf16_pools)
    baseline = runners[0].name
    peers = [VllmRunner(model_dir, dtype, cores, prompt_len, context, steps) for dtype in vllm_dtypes]
    try:
        rows = measure(runners + peers, tokens, prompt_len, context, steps, reps)
    finally:
        for peer in peers:
            peer.close()
    limit = limits(runners[-1].engine, reps)  # the pools' configuration on this CPU: our last runner
    limit["runner"] = runners[-1].name
    pools_cfg, pools_dtype = runners[-1].engine.model_config, runners[-1].dtype
    runners.clear()
    gc.collect()
    scratch.cleanup()
    for row in rows:
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
    for row in rows:
        base = next(
            r
            for r in rows
            if r["runner"] == baseline and r["phase"] == row["phase"] and r["batch"] == row["batch"]
        )
        row["vs_baseline"] = row["tokens_per_s"] / base["tokens_per_s"]
        peer = [
            r
            for r in rows
            if r["runner"] == f"vLLM CPU {row['dtype']}"
            and r["phase"] == row["phase"]
            and r["batch"] == row["batch"]
        ]
        row["vs_vllm"] = row["tokens_per_s"] / peer[0]["tokens_per_s"] if peer else None
    prefill = next(r for r in rows if r["phase"] == "prefill" and r["runner"] == limit["runner"])
    return dict(
        model=str(model_dir),
        limits=limit,
        prompt_gemm=prompt_gemm(pools_cfg, pools_dtype, prefill, reps),
        cores=list(cores),
        threads=len(cores),
        reps=reps,
        prompt_tokens=prompt_len,
        decode_context=context,
        decode_steps=steps,
        baseline=baseline,
        torch=torch.__version__,
        machine=platform.processor() or platform.machine(),
        rows=rows,
    )


def limits(engine: Engine, reps: int) -> dict:
    """What bounds one decode step of ``engine`` at batch 1, measured on these cores in this run.

    - ``weight_bytes``: the weights a step reads whole, in the layout its decode rows read (the
      kernel's tiles, the block codes, else the compute dtype's): the layers, the final norm and the
      output head (the embedding table is only looked up, one row per token);
    - ``read_gb_s``: summing a 256 MiB float32 tensor, the read-only bandwidth these cores reach;
    - ``copy_gb_s``: a plain 256 MiB copy (bytes copied per second), for reference;
    - ``floor_ms``: weight_bytes / read bandwidth, the step time if only reading the weights counted;
    - ``head_ms``: the output head alone (final norm + [1, hidden] x [hidden, vocab] matmul).
    """
    model = engine.model
    tensors = {id(model.norm): model.norm}
    projections = [model.lm_head]
    for layer in model.layers:
        tensors.update({id(t): t for t in (layer.ln_attn, layer.ln_mlp)})
        projections += [layer.qkv, layer.o, layer.gate_up, layer.down]
    for projection in projections:  # the layout a decode step reads
        if projection.blocks is not None:
            read = [projection.blocks.codes, projection.blocks.scales, projection.blocks.mins]
        elif projection.tiles is not None:
            read = [projection.tiles.tiles]
        else:
            read = [projection.weight if projection.native is None else projection.native.tiles]
        for t in (*read, projection.bias):
            if t is not None:
                tensors[id(t)] = t
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    src = torch.ones(64 << 20, dtype=torch.float32)  # written: no shared zero pages
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    copy_s = median_time(lambda: dst.copy_(src), reps)
    read_s = median_time(lambda: src.sum(), reps)
    x = torch.randn(1, model.embed.shape[1], dtype=model.embed.dtype)
    with torch.inference_mode():
        head_s = median_time(lambda: model._logits(x), reps * 4)
    return dict(
        weight_bytes=weight_bytes,
        read_gb_s=nbytes / read_s / 1e9,
        copy_gb_s=nbytes / copy_s / 1e9,
        floor_ms=weight_bytes / (nbytes / read_s) * 1e3,
        head_ms=head_s * 1e3,
    )


def prompt_gemm(cfg: ModelConfig, dtype: str, prefill: dict, reps: int) -> dict:
    """The projection rate of a measured prefill (``prefill``: its row) beside a reference's, on these
    cores in this run (``benchlib/gemmrate.py``).

    - ``gflop``: 2 x the prompt's tokens x the layers' q, k, v, o, gate, up and down weights, plus 2 x
      the output head's (the last row only);
    - ``gflop_s``: gflop over the prefill's median time (attention, norms and the rest included);
    - ``reference_gflop_s``: gflop over the time ``F.linear`` takes for the same GEMMs in ``dtype`` on
      one thread (one layer's shapes on the prompt's rows, called once per layer, and the head on one
      row), the median of ``reps``;
    - ``vs_reference``: gflop_s / reference_gflop_s.
    """
    flops = prompt_flops(cfg, prefill["tokens"])
    reference_s = reference_seconds(cfg, prefill["tokens"], getattr(torch, dtype), reps)
    rate, reference = flops / prefill["seconds"] / 1e9, flops / reference_s / 1e9
    return dict(
        runner=prefill["runner"],
        dtype=dtype,
        tokens=prefill["tokens"],
        gflop=flops / 1e9,
        gflop_s=rate,
        reference_gflop_s=reference,
        reference_threads=1,
        vs_reference=rate / reference,
    )


def _ms_per_call(row: dict) -> float:
    """Milliseconds per engine call: one prefill, or one decode step (batch tokens each)."""
    calls = 1 if row["phase"] == "prefill" else row["tokens"] // row["batch"]
    return row["seconds"] / calls * 1e3


def table_row(row: dict, extra: list[str]) -> str:
    """A markdown row: phase, batch, runner, tokens/s, ms per call, then `extra` cells."""
    cells = [
        row["phase"],
        row["batch"],
        row["runner"],
        f"{row['tokens_per_s']:.0f}",
        f"{_ms_per_call(row):.1f}",
    ]
    return "| " + " | ".join(str(c) for c in [*cells, *extra]) + " |"


def section(result: dict) -> str:
    """One model's table: prefill and decode tokens/s, milliseconds per call, ratio to the baseline."""
    lines = [
        f"## `{Path(result['model']).name}`",
        "",
        f"Cores {result['cores']}, {result['threads']} thread(s), torch {result['torch']}, "
        f"CPU {result.get('cpu_flags', '?')}; "
        f"prefill of one {result['prompt_tokens']}-token prompt; decode at a "
        f"{result['decode_context']}-token context, {result['decode_steps']} steps; "
        f"median of {result['reps']} interleaved repetitions. "
        f"Ratios are against `{result['baseline']}` in the same run.",
        "",
        "| phase | batch | runner | tokens/s | ms per call | × baseline | × vLLM, same dtype |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        ratios = [f"{r['vs_baseline']:.2f}", "–" if r.get("vs_vllm") is None else f"{r['vs_vllm']:.2f}"]
        lines.append(table_row(r, ratios))
    lim = result["limits"]
    bounded = lim.get("runner", "disagg engine bfloat16")
    step = next(
        r for r in result["rows"] if r["phase"] == "decode" and r["batch"] == 1 and r["runner"] == bounded
    )
    step_ms = _ms_per_call(step)
    lines += [
        "",
        f"What bounds the decode step of `{bounded}` at batch 1 ({step_ms:.1f} ms): its weights are "
        f"{lim['weight_bytes'] / 1e6:.0f} MB, which stream in {lim['floor_ms']:.1f} ms at these cores' "
        f"read-only bandwidth ({lim['read_gb_s']:.1f} GB/s; a copy moves {lim['copy_gb_s']:.1f} GB/s), "
        f"so the step takes {step_ms / lim['floor_ms']:.2f}x the weight-streaming bound; "
        f"the output head alone takes {lim['head_ms']:.1f} ms ({lim['head_ms'] / step_ms:.0%} of the step).",
    ]
    gemm = result["prompt_gemm"]
    lines += [
        "",
        f"The projections of `{gemm['runner']}`'s prefill ({gemm['tokens']} tokens): 2 x tokens x the "
        "layers' q, k, v, o, gate, up and down weights, plus 2 x the output head's on the last row, over "
        "the whole prefill's time; beside `F.linear` on one thread on the same GEMMs in the same dtype "
        "(one layer's shapes, called once per layer, and the head on one row), timed in this run.",
        "",
        "| runner | dtype | GFLOP | GFLOP/s | F.linear 1-thread GFLOP/s | × F.linear |",
        "|---|---|---:|---:|---:|---:|",
        f"| {gemm['runner']} | {gemm['dtype']} | {gemm['gflop']:.2f} | {gemm['gflop_s']:.1f} "
        f"| {gemm['reference_gflop_s']:.1f} | {gemm['vs_reference']:.2f} |",
    ]
    return "\n".join(lines) + "\n"


def markdown(results: list[dict]) -> str:
    head = [
        "# Engine speed on CPU cores",
        "",
        "Written by `perf/engine_bench.py` (`make bench-engine`).",
        "",
    ]
    return "\n".join(head) + "\n" + "\n".join(section(r) for r in results)


def cpu_flags() -> str:
    """The CPU features that decide the engine's paths here (AMX, AVX-512-BF16, or AVX2 only)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = set(text.split())
    kinds = [f for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return ", ".join(kinds) or "no AVX2"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        action="append",
        help="checkpoint folder, repeatable (default: $MODEL_DIR, else SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--cores",
        default=str(min(os.sched_getaffinity(0))),
        help="comma-separated cores to compute on, one thread each (default: the first one available)",
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument(
        "--vllm-dtype",
        action="append",
        choices=["bfloat16", "float32"],
        help="run vLLM CPU's offline engine (.venv-vllm, `make .venv-vllm`) in this dtype, repeatable "
        "(default: both when .venv-vllm is installed)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.no_vllm:
        vllm_dtypes: tuple[str, ...] = ()
    elif args.vllm_dtype:
        vllm_dtypes = tuple(args.vllm_dtype)
    else:
        vllm_dtypes = ("bfloat16", "float32") if VLLM_PYTHON.exists() else ()
    if vllm_dtypes and not VLLM_PYTHON.exists():
        parser.error("vLLM is not installed: make .venv-vllm/.installed")
    flags = cpu_flags()
    results = []
    for model in args.model or [None]:
        model_dir = ensure_model(resolve_model_dir(model))
        cores = tuple(int(c) for c in args.cores.split(","))
        result = run(model_dir, cores, args.reps, args.prompt_tokens, args.context, args.steps, vllm_dtypes)
        results.append({**result, "cpu_flags": flags})
    table = markdown(results)
    write_results(args.out_dir, "engine_bench", {"models": results}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
