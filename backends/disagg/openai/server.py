"""``disagg openai``: the OpenAI front end in the foreground, until SIGINT, SIGTERM or SIGHUP.

    disagg openai --triton-url 127.0.0.1:8001 [--host 127.0.0.1] [--port 9000] [--model DIR]

Standalone (a frontend host in front of Triton elsewhere) or as the child that ``disagg serve`` starts
(``--listen-fd``: a socket it bound, so that a busy port fails before Triton starts; ``--watch-parent``:
exit when ``disagg serve`` is gone). On a stop signal it stops accepting, lets requests in flight go on
for ``--drain-s``, then cancels them (their gRPC streams, hence their work on the pools).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from disagg.openai import auth
from disagg.openai.app import create_app
from disagg.openai.chat import ChatTemplate
from disagg.openai.config import ENV_PORT, FrontendConfig, parse_port
from disagg.openai.launcher import listen
from disagg.paths import resolve_model_dir
from disagg.procfs import read_stat
from disagg.serverconfig import LOOPBACK

log = logging.getLogger("disagg.openai")
PARENT_POLL_S = 0.5


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg openai", description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton-url", required=True, help="Triton's gRPC host:port")
    parser.add_argument(
        "--host", default=LOOPBACK, help=f"bind address (default {LOOPBACK}; 0.0.0.0: every interface)"
    )
    parser.add_argument("--port", default=None, help=f"port (default ${ENV_PORT}, else 9000)")
    parser.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--watch-parent", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: $MODEL_DIR, else SmolLM2)")
    parser.add_argument("--model-id", default=None, help="the model's id (default: the folder's name)")
    parser.add_argument("--chat-template", type=Path, default=None, help="a template file to use instead")
    parser.add_argument("--default-max-tokens", type=int, default=256)
    parser.add_argument("--drain-s", type=float, default=5.0)
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help=f"a file holding the key every /v1/* request must bear (default ${auth.ENV_API_KEY}; "
        "neither set: no key is asked)",
    )
    return parser


def config_from(args: argparse.Namespace) -> FrontendConfig:
    model_dir = resolve_model_dir(args.model)
    return FrontendConfig(
        triton_url=args.triton_url,
        model_id=args.model_id or model_dir.resolve().name,
        model_dir=model_dir,
        chat_template=args.chat_template,
        default_max_tokens=args.default_max_tokens,
        drain_s=args.drain_s,
        api_key=auth.load_key(os.environ, args.api_key_file),
    )


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = config_from(args)
        port = parse_port(args.port if args.port is not None else os.environ.get(ENV_PORT))
        ChatTemplate.find(config.model_dir, config.chat_template)  # a broken one fails here, at start
    except (ValueError, OSError) as exc:
        print(f"disagg openai: error: {exc}", file=sys.stderr)
        return 2
    if args.listen_fd is not None:
        sock = socket.socket(fileno=args.listen_fd)
    else:
        try:
            sock = listen(args.host, port)
        except OSError as exc:
            print(f"disagg openai: cannot listen on {args.host}:{port} ({exc.strerror})", file=sys.stderr)
            return 2
    parent = os.getppid() if args.watch_parent else None
    return asyncio.run(_serve(sock, config, parent))


async def _serve(sock: socket.socket, config: FrontendConfig, parent: int | None) -> int:
    app = create_app(config)  # on the running loop: its gRPC channel belongs to this loop
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, stop.set)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=config.drain_s)
    await runner.setup()
    site = web.SockSite(runner, sock, shutdown_timeout=config.drain_s, backlog=512)
    await site.start()
    guard = "API key required" if config.api_key else f"no API key (${auth.ENV_API_KEY} or --api-key-file)"
    log.info("serving %s on %s, %s (Triton gRPC %s)", config.model_id, site.name, guard, config.triton_url)
    watch = asyncio.create_task(_watch_parent(parent, stop)) if parent is not None else None
    try:
        await stop.wait()
    finally:
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        log.info("stopping")
        await runner.cleanup()
        sock.close()
    return 0


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once ``parent`` (``disagg serve``) has exited or this process was re-parented."""
    while True:
        stat = read_stat(parent)
        if os.getppid() != parent or stat is None or stat.exited:
            log.error("disagg serve (pid %d) is gone: stopping", parent)
            stop.set()
            return
        await asyncio.sleep(PARENT_POLL_S)  # a poll of another process's state, not a synchronisation


if __name__ == "__main__":
    sys.exit(main())
