"""The OpenAI front end as a child process of ``disagg serve``, beside Triton.

``FrontendProcess.start`` binds the port here first (a busy port fails before Triton starts, with a
clear message), then starts ``python -m disagg.openai`` on that socket in a session of its own, with an
environment without the admin key (the front end needs no secret). The child answers 503 until Triton's
``llm`` is ready, rides out Triton restarts (gRPC reconnects), and exits when ``disagg serve`` is gone.
``stop`` sends SIGTERM and waits for the drain plus a grace period, then SIGKILLs its process group.
Imports nothing heavy: the launcher only supervises.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

KILL_GRACE_S = 5.0


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (an IPv4 or IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


class FrontendError(RuntimeError):
    """The front end could not be started."""


@dataclass(frozen=True)
class FrontendLaunch:
    """Where the front end listens and what it serves (``chat_template``: a file used instead of the
    model's own template)."""

    address: str
    port: int
    triton_url: str
    model_dir: Path
    drain_s: float = 5.0
    chat_template: Path | None = None
    api_key_file: Path | None = None
    """Where the child reads its API key (else from ``$DISAGG_API_KEY``, inherited)."""


class FrontendProcess:
    def __init__(self, launch: FrontendLaunch, env_drop: tuple[str, ...] = ()) -> None:
        self.launch = launch
        self._env_drop = env_drop
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        host = self.launch.address
        host = "127.0.0.1" if host == "0.0.0.0" else f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.launch.port}/v1"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> FrontendProcess:
        """Bind the port and start the child; raises FrontendError (port busy, start failed)."""
        launch = self.launch
        try:
            sock = listen(launch.address, launch.port)
        except OSError as exc:
            raise FrontendError(
                f"OpenAI front end cannot listen on {launch.address}:{launch.port} ({exc.strerror}); "
                "choose another port with --openai-port or OPENAI_PORT (0 turns it off)"
            ) from None
        env = {k: v for k, v in os.environ.items() if k not in self._env_drop}
        env["MODEL_DIR"] = str(launch.model_dir)
        argv = [
            sys.executable,
            "-m",
            "disagg.openai",
            "--triton-url",
            launch.triton_url,
            "--listen-fd",
            str(sock.fileno()),
            "--watch-parent",
            "--drain-s",
            str(launch.drain_s),
        ]
        if launch.chat_template is not None:
            argv += ["--chat-template", str(launch.chat_template)]
        if launch.api_key_file is not None:
            argv += ["--api-key-file", str(launch.api_key_file)]
        try:  # a process group of its own (killpg), in the caller's session: see disagg.server
            self._process = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, pass_fds=(sock.fileno(),), process_group=0
            )
        except OSError as exc:
            raise FrontendError(f"could not start the OpenAI front end ({type(exc).__name__})") from None
        finally:
            sock.close()  # the child holds its own copy
        return self

    def terminate(self) -> None:
        """Send SIGTERM (the child drains its requests and exits); no wait."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._process.pid, signal.SIGTERM)

    def poll(self) -> int | None:
        """The child's exit status once it has exited, else None."""
        return None if self._process is None else self._process.poll()

    def stop(self) -> int | None:
        """SIGTERM, wait for the drain plus ``KILL_GRACE_S``, then SIGKILL the child's group. Idempotent."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=self.launch.drain_s + KILL_GRACE_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # the child, if it outlived the wait, and anything it left
        return process.wait()
