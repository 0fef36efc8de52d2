"""The ``disagg`` command: generate text, build the default model, size KV caches, serve."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable

from disagg.engine.errors import EngineError
from disagg.paths import ensure_model, resolve_model_dir


def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="disagg generate", description="Generate text with the engine.")
    parser.add_argument("--model", help="checkpoint folder (default: $MODEL_DIR, else SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-length", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)

    from disagg.engine.engine import Engine, EngineConfig
    from disagg.engine.params import SamplingParams
    from disagg.engine.scheduler import generate
    from disagg.engine.sequence import Request
    from disagg.engine.tokenizer import Tokenizer

    model_dir = ensure_model(resolve_model_dir(args.model))
    tokenizer = Tokenizer(model_dir)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        min_length=args.min_length,
    )
    engine = Engine(EngineConfig(model_dir=model_dir, dtype=args.dtype, device=args.device, kv_cache_mb=64))
    prompt_ids = tokenizer.encode(args.prompt)
    token_ids, reason = generate(engine, Request(tuple(prompt_ids), params))
    text = tokenizer.decode(token_ids)
    if args.json:
        record = {
            "prompt_token_ids": prompt_ids,
            "token_ids": token_ids,
            "text": text,
            "finish_reason": reason,
        }
        print(json.dumps(record, ensure_ascii=False))
    else:
        print(text)
    return 0


def _make_model(argv: list[str]) -> int:
    from disagg_tools.tiny_model import main

    return main(argv)


def _prepare_model(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="disagg prepare-model",
        description="Make the model ready: fetch or build the project's own model folders when missing; "
        "check any other folder (MODEL_DIR, --model) without ever writing to it.",
    )
    parser.add_argument("--model", help="checkpoint folder (default: $MODEL_DIR, else the default model)")
    args = parser.parse_args(argv)
    print(ensure_model(resolve_model_dir(args.model)))
    return 0


def _fetch_model(argv: list[str]) -> int:
    from disagg_tools.catalog import main

    return main(argv)


def _kvcalc(argv: list[str]) -> int:
    from disagg_tools.kvcalc import main

    return main(argv)


def _repository(argv: list[str]) -> int:
    from disagg_tools.repository import main

    return main(argv)


def _autoscale(argv: list[str]) -> int:
    from disagg_tools.autoscaler import main

    return main(argv)


def _serve(argv: list[str]) -> int:
    from disagg.server import serve_main

    return serve_main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "generate": (_generate, "generate text from a prompt with the reference engine"),
    "make-model": (_make_model, "write the embedded tiny Llama-style checkpoint"),
    "prepare-model": (_prepare_model, "fetch or build the default model if missing; check any other"),
    "fetch-model": (_fetch_model, "fetch a real model (SmolLM2) or convert a GGUF file into a checkpoint"),
    "kvcalc": (_kvcalc, "KV cache bytes per token/request and transfer time per link"),
    "repository": (_repository, "write the model repository (config.pbtxt per model)"),
    "serve": (_serve, "run Triton with the project's model repository"),
    "autoscale": (_autoscale, "scale the pools from their metrics (log, triton or kubernetes actuator)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: disagg COMMAND [options]\n\ncommands:\n" + "\n".join(lines), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, _ = COMMANDS[argv[0]]
    try:
        return command(argv[1:])
    except (EngineError, ValueError) as exc:
        print(f"disagg {argv[0]}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
