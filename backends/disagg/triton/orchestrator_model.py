"""Adapter of the orchestrator, as an ensemble step (``orchestrator``) or served directly (``llm``).

``execute`` returns a coroutine: for a decoupled model the Python backend runs it in the background on
its event loop, so many requests are in flight at once on one instance.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from disagg.affinity import pin_process
from disagg.broker import BrokerClient
from disagg.config import build
from disagg.control import ModelControl, loadable_config
from disagg.engine.tokenizer import Tokenizer
from disagg.paths import resolve_model_dir
from disagg.protocol.errors import UNAVAILABLE, Reason, ServingError, classify, invalid
from disagg.serverconfig import ENV_SERVER_HTTP
from disagg.serving.auth import TokenSigner
from disagg.serving.health import DEAD, Change, PoolState
from disagg.serving.ladder import ladder_pools
from disagg.serving.orchestrator import HOT_POOL, Orchestrator, OrchestratorConfig
from disagg.serving.routing import PINNED, RoutingFile
from disagg.serving.telemetry import SloWindow
from disagg.serving.text_api import (
    ERROR_CODE_INPUT,
    LLM_INPUT_NAMES,
    OUTPUT_NAME,
    parse_text_request,
    wants_error_code,
)
from disagg.serving.watcher import PoolWatcher
from disagg.tls import grpc_tls
from disagg.triton import glue, wire
from disagg.triton.bls import TritonPools
from disagg.triton.degradation import DegradationMetrics
from disagg.triton.graveyard import Graveyard
from disagg.triton.pools import Pools
from disagg.triton.readiness import ServerReadiness
from disagg.triton.remote import RemotePools, new_client
from disagg.triton.request_metrics import OrchestratorMetrics, VersionMetrics

log = logging.getLogger(__name__)


class TritonResponder:
    def __init__(self, pb_utils: Any, sender: Any, graveyard: Graveyard) -> None:
        self._pb = pb_utils
        self._sender = sender
        self._graveyard = graveyard
        # set once the request is parsed: the optional outputs it asked for (text_api.EXTRA_OUTPUTS)
        self.extra_outputs: frozenset[str] = frozenset()
        self.prompt_tokens = 0
        self.error_codes = False  # text_api.ERROR_CODE_INPUT: error messages start with their code
        self.answered = False  # a response with tensors was sent

    def send(self, text: str, final: bool, tokens: int = 0, finish_reason: str | None = None) -> None:
        """One piece of the answer. A final piece with nothing to say is sent as flags alone, unless
        nothing was sent before it: an empty answer (the end token first) is still one response with
        an empty text, since HTTP `generate` and the ensemble need exactly one for a whole answer."""
        pb = self._pb
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if final and not text and not self.extra_outputs and self.answered:
            self._sender.send(flags=flags)
            return
        self.answered = True
        tensors = [glue.bytes_tensor(pb, OUTPUT_NAME, text.encode("utf-8"), shape=(1, 1))]
        tensors += self._extras(tokens, finish_reason if final else None)
        self._sender.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)

    def _extras(self, tokens: int, finish_reason: str | None) -> list[Any]:
        pb, wanted = self._pb, self.extra_outputs
        out = []
        if "num_input_tokens" in wanted:
            out.append(pb.Tensor("num_input_tokens", np.array([[self.prompt_tokens]], dtype=np.uint32)))
        if "num_output_tokens" in wanted:
            out.append(pb.Tensor("num_output_tokens", np.array([[tokens]], dtype=np.uint32)))
        if "finish_reason" in wanted:
            out.append(glue.bytes_tensor(pb, "finish_reason", finish_reason or "", shape=(1, 1)))
        return out

    def fail(self, error: ServingError) -> None:
        if self.error_codes:
            error = ServingError(error.code, f"{error.code}: {error.message}", error.reason)
        glue.send_error(self._pb, self._sender, error)

    def is_cancelled(self) -> bool:
        # the check is a round trip through the stub's queue: it also frees finished BLS iterators
        return self._graveyard.checked(self._sender.is_cancelled)


class OrchestratorModel:
    def __init__(self, args: dict[str, Any], pb_utils: Any, *, direct: bool) -> None:
        self._pb = pb_utils
        self.direct = direct  # llm: text in, tokenized here; else input_ids from preprocessing
        # every parameter typed and range-checked once; an unknown one is a ConfigError naming it
        self.config = build(OrchestratorConfig, glue.model_parameters(args), strings=True)
        cores = glue.parse_cores(self.config.cores, args["model_instance_name"])
        if cores:
            pin_process(cores)  # the stub's own threads too, not only those started from here
        self.max_inflight = self.config.max_inflight
        self.tokenizer = Tokenizer(resolve_model_dir(self.config.model_dir))
        secret_file = self.config.secret_file
        signer = TokenSigner(glue.deployment_secret(str(secret_file) if secret_file else ""))
        local = TritonPools(pb_utils, signer, self.config.pool_models, self.max_inflight)
        local.stubs.start()  # which of this server's pool stubs died (triton.stubs)
        remote = None
        if self.config.remote.servers:  # pools of other servers, over gRPC
            timeout = self.config.request_timeout_s
            tls = grpc_tls(self.config.remote.tls)
            dial = functools.partial(new_client, tls=tls)  # mutual TLS when the spec asks for it
            remote = RemotePools(signer, self.config.remote.servers, self.config.pool_models, timeout, dial)
        self.pools = Pools(local, remote)
        instance = args["model_instance_name"]
        deployed = deployed_pools(self.config, args.get("model_repository", ""))
        # readiness over the server's HTTP endpoint (see readiness): without it a silent pool cannot
        # be told from one being unloaded, so it is routed around but never restarted
        self.readiness = ServerReadiness.from_environment()
        recovery = self.config.health.recovery and self.readiness is not None
        # restarts share the server's one model-control owner with the autoscaler's actuator
        self.control = ModelControl(self.readiness.base) if self.readiness is not None else None
        if self.config.health.recovery and self.readiness is None:
            log.warning("%s not set: pools that die are routed around, not restarted", ENV_SERVER_HTTP)
        self.degradation = DegradationMetrics(
            pb_utils, args["model_name"], self.config.mode, instance, self.config.ladder, deployed, recovery
        )
        self.orchestrator = Orchestrator(
            self.config, self.pools, self.tokenizer.decode, deployed=deployed, on_change=self._changed
        )
        self.pools.overloaded = self._overloaded
        self.watcher = PoolWatcher(
            self.orchestrator,
            self._restart if recovery else None,
            on_restart=self.degradation.restarted,
            on_recovered=self.degradation.recovered,
            is_ready=self._is_ready if self.readiness is not None else None,
            restartable=lambda pool: not self.pools.is_remote(pool),
            stub_dead=lambda pool: not self.pools.is_remote(pool) and local.stubs.dead(pool),
        )
        self._watching: asyncio.Task[None] | None = None
        self._inflight = 0
        slo = self.config.slo
        self.metrics = OrchestratorMetrics(
            pb_utils,
            args["model_name"],
            self.config.mode,
            SloWindow(slo),
            instance,
            open_calls=lambda: self.pools.open_calls,
            hot_groups=lambda: self.orchestrator.hot_groups(time.monotonic()),
            remote_servers=remote.server_counts if remote is not None else None,
            remote_pools=tuple(self.config.remote.servers),
            hot_rate=self.orchestrator.hot_rate,
        )
        self.metrics.start_refresher()
        # the pool versions new requests take during a rollout (serving.routing); none: no pins
        self.routing = RoutingFile(self.control.routing_path) if self.control is not None else None
        self.versions = VersionMetrics(pb_utils, args["model_name"], instance)

    def _changed(self, change: Change) -> None:
        if change.new is PoolState.GONE and change.reason == DEAD:
            self.pools.pool_lost(change.pool)  # its open calls will never be answered
        self.degradation.changed(change)
        self.degradation.serving(self.orchestrator.ladder.mode)

    def _overloaded(self, pool: str) -> bool:
        """The pool is saturated as this orchestrator sees it (slow probes, refusals, a full queue)."""
        health = self.orchestrator.health.get(pool)
        return health is not None and health.state is PoolState.SATURATED

    def _pool_ready(self, pool: str) -> bool:
        """Whether the server reports the pool's model ready (blocks: an HTTP round trip)."""
        readiness = self.readiness
        return readiness is not None and readiness.model_ready(self.config.pool_models[pool])

    async def _is_ready(self, pool: str) -> bool:
        if self.pools.is_remote(pool):
            return True  # its pings say whether any of its servers serves it
        return await asyncio.get_running_loop().run_in_executor(None, self._pool_ready, pool)

    async def _restart(self, pool: str) -> bool:
        """Restart a gone pool's model through model control, on a thread (the calls block).

        On Triton 2.51 a load of a loaded model whose files did not change is a no-op, even when its
        stub is dead (it stays READY): the model is unloaded first (that returns at once; the dead
        instance is dropped in the background), then loaded, which starts a new stub. The load carries
        the model's live config, so an instance count set by the autoscaler survives the restart. It
        runs as the server's one model-control owner (``disagg.control``): a restart that another
        entry point's watcher made since this one found the pool dead is not made again.

        The server's model-control broker makes the calls when there is one (``disagg.broker``: a load
        through ``pb_utils`` holds this stub's GIL until it ends, which stops every stream of this
        entry point for the whole load); without one, ``pb_utils`` does."""
        name = self.config.pool_models[pool]
        gone_for = self.watcher.gone_for(pool) or 0.0
        found_dead_at = time.time() - gone_for

        control, readiness = self.control, self.readiness
        if control is None or readiness is None:
            return False  # no recovery without the server's endpoint (see initialize)
        broker = BrokerClient(readiness.base, control=control)

        def restart() -> bool:
            if not self._pool_ready(pool):
                return False  # being unloaded (a shutdown, an operator)
            live = readiness.model_config(name)
            self._pb.unload_model(name)
            if live is None:
                self._pb.load_model(name)  # the repository's files, as at start-up
            else:
                self._pb.load_model(name, config=json.dumps(loadable_config(live)))
            return True

        def restart_once() -> bool:
            if broker.available():
                done = bool(broker.call("restart", name, found_dead_at=found_dead_at))
            else:
                done = control.restart_once(name, found_dead_at, restart)
            if not done:
                log.info(
                    "pool %s: not restarted here (restarted since it was found dead, or unloading)", pool
                )
            return done

        return await asyncio.get_running_loop().run_in_executor(None, restart_once)

    def _watch(self) -> None:
        """Start the pool watcher on the backend's event loop (it exists once requests arrive)."""
        if self._watching is None:
            self._watching = asyncio.get_running_loop().create_task(self.watcher.run())

    def execute(self, requests: list[Any]) -> Any:
        return self._execute(requests)

    async def _execute(self, requests: list[Any]) -> None:
        self._watch()
        await asyncio.gather(*(self._one(r) for r in requests))

    async def _one(self, request: Any) -> None:
        arrival = time.monotonic()
        sender = request.get_response_sender()
        responder = TritonResponder(self._pb, sender, self.pools.graveyard)
        if self.direct:
            flags = glue.input_arrays(self._pb, request, (ERROR_CODE_INPUT,))
            responder.error_codes = wants_error_code(flags)
        try:
            if self.control is not None and self.control.draining_path.exists():
                raise ServingError(UNAVAILABLE, "server is shutting down", Reason.DRAINING)
            if self._inflight >= self.max_inflight:
                limit = f"server is at its limit of {self.max_inflight} requests"
                raise ServingError(UNAVAILABLE, limit, Reason.SHED)
            text, prompt_ids = self._parse(request, responder)
        except Exception as exc:
            error = classify(exc)
            responder.fail(error)
            self.metrics.refused(error)
            return
        self._inflight += 1
        # this request's task (and those it starts) calls the pool versions of the routing now
        versions = self.routing.current().versions if self.routing is not None else {}
        PINNED.set(versions)
        self.versions.pin(versions)
        try:
            outcome = await self.orchestrator.serve(prompt_ids, text, responder, arrival)
        finally:
            self._inflight -= 1
            self.versions.unpin(versions)
        try:
            self.metrics.observe(outcome, time.monotonic())
            self.degradation.observe(outcome, self.config.ladder[0])
        except Exception:
            log.warning("recording request metrics failed", exc_info=True)

    def _parse(self, request: Any, responder: TritonResponder) -> tuple[Any, list[int]]:
        pb = self._pb
        if self.direct:
            values = glue.input_arrays(pb, request, LLM_INPUT_NAMES)
            text = parse_text_request(values, glue.request_parameters(request))
            ids = self.tokenizer.encode(text.prompt)
            responder.extra_outputs, responder.prompt_tokens = text.extra_outputs, len(ids)
        else:
            values = glue.input_arrays(pb, request, ("input_ids", "request"))
            raw = glue.first_bytes(values["request"])
            if values["input_ids"] is None or raw is None:
                raise invalid("orchestrator needs input_ids and request (from preprocessing)")
            text = wire.decode_text_request(raw)
            ids = [int(t) for t in np.asarray(values["input_ids"]).reshape(-1)]
        if not ids:
            raise invalid("input 'text_input' encodes to 0 tokens")
        return text, ids

    def finalize(self) -> None:
        # the stub stops its event loop before this: the watcher's task runs no further, and the
        # flag keeps a probe round that is somehow still scheduled from starting calls
        self.watcher.stop()
        self.metrics.stop()
        self.versions.retire()
        self.degradation.retire()
        self.pools.close()


def deployed_pools(config: OrchestratorConfig, model_folder: str) -> tuple[str, ...]:
    """The pools of ``config``'s ladder (and its hot prompts' pool) whose models are in this server's
    repository (the folder above this model's) or on remote servers; all of them when that cannot be
    told."""
    models = config.pool_models
    wanted = [*ladder_pools(config.ladder), *([HOT_POOL] if HOT_POOL in models else [])]
    repository = Path(model_folder).parent if model_folder else None
    if repository is None or not repository.is_dir():
        return tuple(wanted)
    remote = config.remote.servers
    return tuple(
        pool for pool in wanted if pool in remote or (repository / models[pool] / "config.pbtxt").is_file()
    )
