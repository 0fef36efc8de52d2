"""``disagg kvcalc``: how many bytes of KV cache a request carries, and how long moving it takes.

KV bytes per token = 2 (keys and values) x layers x KV heads x head dim x bytes per element,
the arithmetic of :class:`disagg.kv.layout.KVLayout`. Two things are easy to get wrong
and this tool spells out: grouped-query attention caches only the KV heads (Llama-3-70B
caches 8 heads, not 64), and the element size depends on the dtype (2 bytes for
float16/bfloat16, 4 for float32).

Transfer times use nominal line rates from :data:`LINKS`; real copies reach a fraction of
them, so read the times as lower bounds.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from disagg.kv.layout import DTYPE_BYTES, KVLayout, LayoutError

DEFAULT_DTYPE = "float16"


class KVCalcError(ValueError):
    """Bad input: the message is shown to the user as-is."""


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that size a KV cache; ``dtype`` is the checkpoint's, if it says."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str | None = None


@dataclass(frozen=True)
class Link:
    """A link's bandwidth in GB/s, where 1 GB = 10^9 bytes, one direction, nominal."""

    name: str
    gbps: float
    note: str = ""


# Published dimensions (OPT paper, table 1; Llama 2 paper and the released HF configs;
# Llama 3 released HF configs). dtype is the released checkpoint's.
PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("opt-13b", 40, 40, 40, 128, "float16"),  # d_model 5120
        ModelShape("opt-66b", 64, 72, 72, 128, "float16"),  # d_model 9216
        ModelShape("opt-175b", 96, 96, 96, 128, "float16"),  # d_model 12288
        ModelShape("llama-2-7b", 32, 32, 32, 128, "float16"),  # hidden 4096
        ModelShape("llama-2-13b", 40, 40, 40, 128, "float16"),  # hidden 5120
        ModelShape("llama-2-70b", 80, 64, 8, 128, "float16"),  # hidden 8192, GQA
        ModelShape("llama-3-8b", 32, 32, 8, 128, "bfloat16"),  # hidden 4096, GQA
        ModelShape("llama-3-70b", 80, 64, 8, 128, "bfloat16"),  # hidden 8192, GQA
        # The project's embedded test model (disagg_tools.tiny_model); kept equal by a test.
        ModelShape("disagg-tiny", 8, 8, 4, 64, "float32"),
    )
}

# One direction, because a KV hand-off is a one-way copy. NVIDIA's headline NVLink
# figures (600 / 900 / 1800 GB/s) add both directions; they are halved here.
LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link("pcie3", 16.0, "PCIe 3.0 x16"),
        Link("pcie4", 32.0, "PCIe 4.0 x16"),
        Link("pcie5", 64.0, "PCIe 5.0 x16"),
        Link("nvlink3", 300.0, "A100 NVLink 3; 600 GB/s headline counts both directions"),
        Link("nvlink4", 450.0, "H100/H200 NVLink 4; 900 GB/s headline counts both directions"),
        Link("nvlink5", 900.0, "B200 NVLink 5; 1800 GB/s headline counts both directions"),
        Link("rdma-ib-hdr", 25.0, "InfiniBand HDR, 200 Gb/s"),
        Link("rdma-ib-ndr", 50.0, "InfiniBand NDR, 400 Gb/s"),
        Link("ethernet-10g", 1.25, "10 Gb/s Ethernet"),
        Link("ethernet-25g", 3.125, "25 Gb/s Ethernet"),
        Link("ethernet-100g", 12.5, "100 Gb/s Ethernet"),
        Link("ethernet-400g", 50.0, "400 Gb/s Ethernet"),
    )
}

UNITS_NOTE = "GB/s = 10^9 bytes/s, one direction, nominal line rate: real transfers are slower"
_LINK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


# ------------------------------------------------------------------------ model shape
def shape_from_config(path: Path) -> ModelShape:
    """Read the KV-relevant dimensions of a Hugging Face ``config.json`` (file or folder)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KVCalcError(f"no config.json found at {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KVCalcError(f"cannot read {file}: {exc}") from None
    except ValueError as exc:
        raise KVCalcError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise KVCalcError(f"{file} must hold a JSON object")
    # Multimodal checkpoints keep the decoder's dimensions under text_config.
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    layers = _positive_int(config, "num_hidden_layers")
    heads = _positive_int(config, "num_attention_heads")
    kv_heads = _positive_int(config, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise KVCalcError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = config.get("head_dim")
    if head_dim is None:
        hidden = _positive_int(config, "hidden_size")
        if hidden % heads:
            raise KVCalcError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
        head_dim = hidden // heads
    else:
        head_dim = _positive_int(config, "head_dim")
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise KVCalcError(f"config dtype must be a string, got {dtype!r}")
    return ModelShape(path.name or str(path), layers, heads, kv_heads, head_dim, dtype)


def _positive_int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None:
        if default is None:
            raise KVCalcError(f"config.json has no {key}")
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise KVCalcError(f"config.json {key} must be a positive integer, got {value!r}")
    return value


def preset(name: str) -> ModelShape:
    """A preset by name, case-insensitive."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise KVCalcError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None


def resolve_dtype(shape: ModelShape, override: str | None) -> tuple[str, str]:
    """The dtype to size with and where it came from (``--dtype``, the model, or default)."""
    if override is not None:
        return override, "--dtype"
    if shape.dtype is None:
        return DEFAULT_DTYPE, "default"
    if shape.dtype not in DTYPE_BYTES:
        raise KVCalcError(f"model dtype {shape.dtype!r} is not one of {', '.join(DTYPE_BYTES)}; pass --dtype")
    return shape.dtype, "model"


# ------------------------------------------------------------------------------ links
def parse_link(spec: str) -> Link:
    """``NAME=GBPS`` (GB = 10^9 bytes) into a :class:`Link`."""
    name, sep, rate = spec.partition("=")
    name = name.strip()
    if not sep or not _LINK_NAME.match(name):
        raise KVCalcError(f"--link wants NAME=GBPS with a plain name, got {spec!r}")
    try:
        gbps = float(rate)
    except ValueError:
        raise KVCalcError(f"--link {name}: bandwidth {rate!r} is not a number") from None
    if not math.isfinite(gbps) or gbps <= 0:
        raise KVCalcError(f"--link {name}: bandwidth must be a positive number of GB/s")
    return Link(name, gbps, "user-defined")


def select_links(names: str | None, extra: list[str]) -> list[Link]:
    """Built-in links named in ``names`` (all when None), then the ``--link`` ones."""
    custom = [parse_link(spec) for spec in extra]
    custom_by_name = {link.name: link for link in custom}
    if names is None:
        chosen = [link for link in LINKS.values() if link.name not in custom_by_name]
    else:
        chosen = []
        for name in (n.strip() for n in names.split(",")):
            if not name or name in custom_by_name:
                continue
            if name not in LINKS:
                raise KVCalcError(
                    f"unknown link {name!r}; known: {', '.join(LINKS)} (or add --link NAME=GBPS)"
                )
            chosen.append(LINKS[name])
    return chosen + custom


# ------------------------------------------------------------------------- the report
def compute(shape: ModelShape, dtype: str, tokens: int, batch: int, links: list[Link]) -> dict[str, Any]:
    """The calculation as plain data (what ``--json`` prints)."""
    if tokens < 1 or batch < 1:
        raise KVCalcError("--tokens and --batch must be at least 1")
    try:
        # block_size 1: exact per-token bytes, no rounding up to whole blocks.
        layout = KVLayout(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype, block_size=1)
    except LayoutError as exc:
        raise KVCalcError(str(exc)) from None
    per_token = layout.bytes_per_token
    per_request = per_token * tokens
    per_batch = per_request * batch
    return {
        "model": {**asdict(replace(shape, dtype=dtype)), "dtype_bytes": layout.dtype_bytes},
        "tokens": tokens,
        "batch": batch,
        "bytes_per_token": per_token,
        "bytes_per_request": per_request,
        "bytes_per_batch": per_batch,
        # What the same model would cache with one KV head per attention head.
        "mha_bytes_per_token": per_token * shape.num_attention_heads // shape.num_kv_heads,
        "links": [
            {
                "name": link.name,
                "gbps": link.gbps,
                "note": link.note,
                "seconds_per_request": per_request / (link.gbps * 1e9),
                "seconds_per_batch": per_batch / (link.gbps * 1e9),
            }
            for link in links
        ],
        "units": UNITS_NOTE,
    }


def format_text(report: dict[str, Any], dtype_source: str) -> str:
    """The human-readable rendering of :func:`compute`'s report."""
    m, tokens, batch = report["model"], report["tokens"], report["batch"]
    gqa = m["num_kv_heads"] < m["num_attention_heads"]
    lines = [
        f"model {m['name']}: {m['num_layers']} layers, {m['num_kv_heads']} KV heads"
        f" ({'GQA, ' if gqa else ''}{m['num_attention_heads']} attention heads), head dim {m['head_dim']},"
        f" {m['dtype']} ({m['dtype_bytes']} bytes/element, from {dtype_source})",
        f"KV per token:    {_bytes(report['bytes_per_token'])}"
        f"   = 2 x {m['num_layers']} x {m['num_kv_heads']} x {m['head_dim']} x {m['dtype_bytes']}",
        f"KV per request:  {_bytes(report['bytes_per_request'])}   ({tokens:,} tokens)",
    ]
    if batch > 1:
        lines.append(f"KV per batch:    {_bytes(report['bytes_per_batch'])}   ({batch} requests)")
    if report["links"]:
        lines += ["", f"transfer time ({UNITS_NOTE}):"]
        header = f"  {'link':<16}{'GB/s':>9}  {'per request':>12}"
        lines.append(header + (f"  {'per batch':>12}" if batch > 1 else "") + "  note")
        for link in report["links"]:
            row = f"  {link['name']:<16}{link['gbps']:>9g}  {_seconds(link['seconds_per_request']):>12}"
            if batch > 1:
                row += f"  {_seconds(link['seconds_per_batch']):>12}"
            lines.append(f"{row}  {link['note']}")
    lines += ["", "notes:"]
    if gqa:
        ratio = m["num_attention_heads"] // m["num_kv_heads"]
        lines.append(
            f"  - grouped-query attention: only the {m['num_kv_heads']} KV heads are cached; sizing with all"
            f" {m['num_attention_heads']} heads would overstate the cache {ratio}x"
            f": {_bytes(report['mha_bytes_per_token'])} per token."
        )
    else:
        lines.append("  - multi-head attention: every attention head has its own K and V.")
    lines.append(
        "  - 2 x layers x KV heads x head dim counts elements; bytes need the element size"
        " (2 for float16/bfloat16, 4 for float32)."
    )
    return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n:,} B ({n / size:.2f} {unit})"
    return f"{n:,} B"


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


# ------------------------------------------------------------------------------- CLI
class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse exits the process on bad input; raise instead so main() returns 2.
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="disagg kvcalc",
        description="KV cache bytes per token/request and transfer time per link.",
        epilog=f"presets: {', '.join(PRESETS)}. links: {', '.join(LINKS)}. {UNITS_NOTE}.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="Hugging Face checkpoint folder or config.json")
    source.add_argument("--preset", help="published model dimensions, e.g. llama-3-70b")
    parser.add_argument("--tokens", type=int, required=True, help="tokens per request (prompt length)")
    parser.add_argument("--batch", type=int, default=1, help="requests moved together (default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="KV dtype (default: the model's)")
    parser.add_argument("--links", help="comma-separated built-in links to show (default: all)")
    parser.add_argument(
        "--link", action="append", default=[], metavar="NAME=GBPS", help="add a link (GB = 10^9 bytes)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the calculator; 0 on success, 2 on bad input (message on stderr)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        shape = shape_from_config(args.model) if args.model is not None else preset(args.preset)
        dtype, dtype_source = resolve_dtype(shape, args.dtype)
        report = compute(shape, dtype, args.tokens, args.batch, select_links(args.links, args.link))
    except (_UsageError, KVCalcError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_text(report, dtype_source))
    return 0


if __name__ == "__main__":
    sys.exit(main())
