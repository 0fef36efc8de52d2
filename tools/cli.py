"""The ``disagg`` command: generate text, build the default model, size KV caches, serve.

``serve_main`` (``disagg serve``) supervises a ``disagg.server.TritonServer`` in the foreground until
SIGINT/SIGTERM/SIGHUP, and starts it again if it dies on its own after it was ready (``disagg.restart``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from disagg.engine.errors import EngineError
from disagg.kv.secret import ENV_VAR as ENV_SECRET
from disagg.openai.auth import ENV_API_KEY, load_key
from disagg.openai.config import DEFAULT_PORT, ENV_PORT, parse_port
from disagg.openai.launcher import FrontendError, FrontendLaunch, FrontendProcess
from disagg.paths import resolve_model_dir
from disagg.restart import RestartPolicy
from disagg.server import KILL_GRACE_S, ServerTimeout, TritonServer
from disagg.serverconfig import (
    ADMIN_HEADER,
    ADMIN_KEY_FILE,
    DEFAULT_EXIT_TIMEOUT_S,
    DEFAULT_REPOSITORY,
    ENV_ADMIN_KEY,
    LOOPBACK,
    STATE_DIR,
    ServerError,
    exposure,
    parse_cpus,
    redact,
    server_config,
)
from disagg.tls import GrpcTls
from disagg_tools.checkpoints import ensure_model

SPEC_REPOSITORY = "spec-repository"  # under STATE_DIR: what `disagg serve --spec` serves


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
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)

    from disagg.engine.engine import Engine, EngineConfig
    from disagg.engine.params import SamplingParams
    from disagg.engine.sequence import Request
    from disagg.engine.tokenizer import Tokenizer
    from disagg.pool.offline import generate

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


def _manifests(argv: list[str]) -> int:
    from disagg_tools.manifests import main

    return main(argv)


def _rollout(argv: list[str]) -> int:
    from disagg_tools.rollout import main

    return main(argv)


def _profile(argv: list[str]) -> int:
    from disagg_tools.planner.cli import profile_main

    return profile_main(argv)


def _plan(argv: list[str]) -> int:
    from disagg_tools.planner.cli import plan_main

    return plan_main(argv)


def _autoscale(argv: list[str]) -> int:
    from disagg_tools.autoscaler import main

    return main(argv)


def _serve(argv: list[str]) -> int:
    return serve_main(argv)


def _openai(argv: list[str]) -> int:
    from disagg.openai.server import main

    return main(argv)


def serve_main(argv: Sequence[str] | None = None) -> int:
    """Run Triton in the foreground on a model repository until SIGINT, SIGTERM or SIGHUP, with the
    OpenAI-compatible front end beside it (``disagg.openai``; port 9000, ``OPENAI_PORT``, 0: off).

    The signal is forwarded to the server's process group and to the front end; both drain in-flight
    requests up to the exit timeout. Returns the server's exit status (128 + signal number if it had to
    be killed).
    """
    parser = argparse.ArgumentParser(prog="disagg serve", description=serve_main.__doc__)
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY)
    parser.add_argument("--exit-timeout", type=int, default=DEFAULT_EXIT_TIMEOUT_S, metavar="SECONDS")
    parser.add_argument("--log-verbose", type=int, default=0, metavar="LEVEL")
    parser.add_argument(
        "--address",
        default=LOOPBACK,
        help=f"bind address of gRPC, HTTP, the metrics and the OpenAI front end (default {LOOPBACK}: "
        "this machine only; 0.0.0.0 exposes them on every interface). A pool role (--role prefill or "
        "decode) keeps HTTP on loopback: only gRPC, the pools' link, is exposed",
    )
    parser.add_argument(
        "--cpus",
        default="",
        help="pin tritonserver's own threads, e.g. '0' to keep them off a decode core (pools and "
        "orchestrators still pin themselves to their `cores`); default: unpinned",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        metavar="N",
        help="restart tritonserver when it dies on its own after it was ready, at most N times in 10 "
        "minutes (0: never); see disagg.restart for why",
    )
    parser.add_argument(
        "--openai-port",
        default=None,
        metavar="PORT",
        help=f"port of the OpenAI-compatible front end (default ${ENV_PORT}, else {DEFAULT_PORT}; 0: off)",
    )
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help=f"a file holding the key the OpenAI front end asks of every /v1/* request (default "
        f"${ENV_API_KEY}; neither set: no key is asked)",
    )
    parser.add_argument(
        "--spec",
        type=Path,
        default=None,
        help=f"serve the deployment spec's repository (deploy/spec.yaml), written afresh into "
        f"{STATE_DIR / SPEC_REPOSITORY} (instead of --model-repository)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set one of the spec's keys by its path (kv.prefix_cache=false), on --spec's file or on the "
        "defaults; the repository is then written afresh as with --spec; repeatable",
    )
    parser.add_argument(
        "--role",
        choices=("frontend", "prefill", "decode"),
        default=None,
        help="serve one part of a multi-host deployment, its repository written afresh into "
        f"{STATE_DIR}/role-ROLE (with --spec: the spec's layout, its remote section naming the pools): "
        "the entry points (frontend, with --remote-pools) or one pool (KV over nixl; share "
        "DISAGG_SECRET between the hosts)",
    )
    parser.add_argument(
        "--remote-pools",
        default="",
        metavar="POOL=SERVERS;...",
        help="the frontend's pools: e.g. 'prefill=10.0.0.2:8001;decode=dns:decode.ns.svc:8001'",
    )
    args = parser.parse_args(argv)
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    if args.remote_pools and (args.role != "frontend" or args.spec is not None):
        parser.error("--remote-pools goes with --role frontend (a spec says them in its remote section)")
    grpc_tls: Path | None = None
    if args.set and args.spec is None and args.role is not None:
        parser.error("--set with --role goes on a spec: give --spec")
    if args.spec is not None or args.set:
        if args.model_repository != DEFAULT_REPOSITORY:
            parser.error("--spec and --set name the repository to serve; drop --model-repository")
        from disagg_tools.repository import write_owned

        folder = STATE_DIR / (SPEC_REPOSITORY if args.role is None else f"{SPEC_REPOSITORY}-{args.role}")
        try:
            args.model_repository = write_owned(args.spec, folder, args.role or "all", args.set)
            grpc_tls = pool_tls(args.spec, args.role)  # a pool role: --spec was given
        except ValueError as exc:
            print(f"disagg serve: {exc}", file=sys.stderr)
            return 2
    elif args.role is not None:
        if args.model_repository != DEFAULT_REPOSITORY:
            parser.error("--role writes the repository to serve; drop --model-repository")
        from disagg_tools.repository import write_role

        try:
            args.model_repository = write_role(args.role, args.remote_pools, STATE_DIR / f"role-{args.role}")
        except ValueError as exc:
            print(f"disagg serve: {exc}", file=sys.stderr)
            return 2
    try:
        openai_port = parse_port(
            args.openai_port if args.openai_port is not None else os.environ.get(ENV_PORT)
        )
        # read once, before anything starts: a bad key fails here
        keyed = bool(openai_port) and load_key(os.environ, args.api_key_file) is not None
    except ValueError as exc:
        parser.error(str(exc))
    frontend: FrontendProcess | None = None
    policy = RestartPolicy(max_restarts=args.max_restarts)
    stopping: list[int] = []
    holder: list[TritonServer] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        for server in holder:
            server.signal(signum)
        if frontend is not None:
            frontend.terminate()

    def fail(exc: Exception) -> int:
        print(f"disagg serve: {redact(str(exc), os.environ.get(ENV_ADMIN_KEY, ''))}", file=sys.stderr)
        return 2

    # Installed before the start, so that no signal can leave an orphaned server behind.
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        try:
            config = server_config(
                args.model_repository,
                exit_timeout_s=args.exit_timeout,
                log_verbose=args.log_verbose,
                address=args.address,
                # Triton's HTTP endpoint has no TLS: a pool between hosts is reached over gRPC only
                **({"http_address": LOOPBACK} if args.role in ("prefill", "decode") else {}),
                **({"grpc_tls": grpc_tls} if grpc_tls is not None else {}),
                cpus=parse_cpus(args.cpus),
            )
        except (ValueError, ServerError, OSError) as exc:
            return fail(exc)
        print(
            f"disagg serve: HTTP {config.http_url}, gRPC {config.grpc_url}, metrics {config.metrics_url}; "
            f"{exposure(config)}; admin APIs need header {ADMIN_HEADER!r} (key in "
            f"{STATE_DIR / ADMIN_KEY_FILE} or ${ENV_ADMIN_KEY})",
            file=sys.stderr,
            flush=True,
        )
        while True:
            server = TritonServer(config)
            holder[:] = [server]
            try:
                server.start()
            except (ValueError, ServerError, OSError) as exc:
                return fail(exc)
            if openai_port and frontend is None:  # once: it outlives Triton restarts
                try:
                    frontend = _start_frontend(args, openai_port, config.grpc_url, keyed)
                except FrontendError as exc:
                    server.stop(grace_s=5)
                    return fail(exc)
            if stopping:
                server.signal(stopping[0])
            status, was_ready = _supervise(server, stopping, frontend)
            clean = bool(stopping) or status == 0
            if not policy.should_restart(now=time.monotonic(), was_ready=was_ready, stopping=clean):
                break
            print(
                f"disagg serve: tritonserver exited with {_describe(status)} while serving; restarting it "
                f"({policy.recent} of at most {policy.max_restarts} restarts in {policy.window_s:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            server.stop(grace_s=5)  # its stubs and shared memory, before the next one starts
    finally:
        if frontend is not None:
            frontend.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    server.stop(grace_s=5)  # already exited: only kills leftover stubs and removes their shared memory
    return 128 - status if status < 0 else status


def pool_tls(spec_path: Path | None, role: str | None) -> Path | None:
    """The TLS folder a pool role serves gRPC with (the spec's ``remote.tls``), None for plain gRPC or
    another role (for which ``spec_path`` may be None); ValueError when the spec is not valid or the
    folder lacks a file."""
    from disagg_tools.spec import load_spec

    if role not in ("prefill", "decode"):
        return None
    folder = load_spec(spec_path).tls_folder(Path(spec_path).resolve().parent)
    return GrpcTls(Path(folder)).folder if folder else None


def _start_frontend(args: argparse.Namespace, port: int, grpc_url: str, keyed: bool) -> FrontendProcess:
    """The OpenAI front end beside a Triton whose gRPC endpoint is ``grpc_url`` (FrontendError: none);
    ``keyed``: an API key is set (the front end reads it itself)."""
    launch = FrontendLaunch(
        address=args.address,
        port=port,
        triton_url=grpc_url,
        model_dir=resolve_model_dir(),
        drain_s=float(args.exit_timeout),
        api_key_file=args.api_key_file,
    )
    # the front end needs neither the admin key nor the deployment secret that signs KV hand-offs
    frontend = FrontendProcess(launch, env_drop=(ENV_ADMIN_KEY, ENV_SECRET)).start()
    guard = (
        "every /v1/* request needs its key" if keyed
        else f"open to whoever reaches it (set ${ENV_API_KEY} or --api-key-file to ask a key)"
    )  # fmt: skip
    print(f"disagg serve: OpenAI-compatible API {frontend.url}, {guard}", file=sys.stderr, flush=True)
    return frontend


def _describe(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-status).name}"
    return f"status {status}"


def _supervise(
    server: TritonServer, stopping: list[int], frontend: FrontendProcess | None = None
) -> tuple[int, bool]:
    """Wait for the server to exit; announce readiness once; after a stop signal, SIGKILL the group if it
    outlives the exit timeout plus `KILL_GRACE_S`; say once if the front end exited on its own.
    Returns the exit status and whether it was ready."""
    deadline: float | None = None
    announced = False
    frontend_reported = False
    while True:
        if frontend is not None and not frontend_reported and not stopping and frontend.poll() is not None:
            frontend_reported = True
            print(
                f"disagg serve: the OpenAI front end exited with status {frontend.poll()}; Triton goes on",
                file=sys.stderr,
                flush=True,
            )
        if stopping and deadline is None:
            deadline = time.monotonic() + server.config.exit_timeout_s + KILL_GRACE_S
        try:
            return server.wait(0.5), announced
        except ServerTimeout:
            if deadline is not None and time.monotonic() >= deadline:
                server.signal(signal.SIGKILL)
        if not announced and not stopping and server.is_ready():
            announced = True
            print("disagg serve: ready", file=sys.stderr, flush=True)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "generate": (_generate, "generate text from a prompt with the reference engine"),
    "make-model": (_make_model, "write the embedded tiny Llama-style checkpoint"),
    "prepare-model": (_prepare_model, "fetch or build the default model if missing; check any other"),
    "fetch-model": (_fetch_model, "fetch a real model (SmolLM2) or convert a GGUF file into a checkpoint"),
    "kvcalc": (_kvcalc, "KV cache bytes per token/request and transfer time per link"),
    "repository": (_repository, "write the model repository (config.pbtxt per model)"),
    "serve": (_serve, "run Triton with the project's model repository (and the OpenAI front end)"),
    "openai": (_openai, "run the OpenAI-compatible front end alone, in front of a Triton's llm model"),
    "manifests": (_manifests, "render the Kubernetes objects of a multi-host deployment spec"),
    "autoscale": (_autoscale, "scale the pools from their metrics (log, triton or kubernetes actuator)"),
    "profile": (
        _profile,
        "measure a pool's prefill and decode step times on its cores, fit, write a profile",
    ),
    "plan": (_plan, "simulate the placements a machine allows from profiles, and recommend one"),
    "rollout": (_rollout, "move a live server's pools to another model version under load (--rollback)"),
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
