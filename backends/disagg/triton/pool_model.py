"""Adapter of the pool roles (prefill, decode, colocated): requests in, engine-loop jobs out."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from disagg.affinity import pin_process
from disagg.engine.tokenizer import Tokenizer
from disagg.pool.instance import PoolConfig, build_instance
from disagg.protocol.errors import UNAVAILABLE, ServingError, classify
from disagg.protocol.messages import Control, Event, Failed, PoolLoad, Stop
from disagg.serving.auth import PARAMETER, TokenSigner, refused
from disagg.triton import glue, wire
from disagg.triton.pool_metrics import PoolReporter
from disagg.triton.readiness import ServerReadiness
from disagg.triton.version import Manifest, read_manifest, run_probe

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 10.0  # within Triton's default exit timeout of the launcher (15 s)

# config.pbtxt parameters the adapter reads itself (role and cores reach PoolConfig after it); every
# other parameter is a PoolConfig or EngineConfig key
ADAPTER_KEYS = ("role", "secret_file", "cores")


class TritonSink:
    """Job events -> responses of one Triton request (called from the engine-loop thread)."""

    def __init__(self, pb_utils: Any, sender: Any, descriptor_output: bool) -> None:
        self._pb = pb_utils
        self._sender = sender
        self._descriptor_output = descriptor_output

    def emit(self, event: Event, final: bool) -> None:
        pb = self._pb
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        # a failure is an event, not an error response: see wire (Triton 2.51 loses those mid-stream)
        outputs = [glue.bytes_tensor(pb, "event", wire.encode_event(event))]
        if self._descriptor_output:
            outputs.append(glue.bytes_tensor(pb, "descriptor", getattr(event, "descriptor", None) or b""))
        self._sender.send(pb.InferenceResponse(output_tensors=outputs), flags=flags)

    def accept(self) -> None:
        """Answer at once with an empty response (no outputs, not final), before any event.

        Triton 2.51's Python backend runs a BLS call on its caller's thread pool (``thread-pool-size``,
        32 per instance) until the call's first response comes. A prefill waiting its turn would hold
        one of those threads for its whole wait; 32 such calls would leave none for the caller's
        pings, stops and its own responses to clients, and a live pool would be declared gone."""
        self._sender.send(self._pb.InferenceResponse(output_tensors=[]), flags=0)

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled()


class PoolModel:
    def __init__(self, args: dict[str, Any], pb_utils: Any) -> None:
        started = time.monotonic()
        self._pb = pb_utils
        params = glue.model_parameters(args)
        self.role = params.get("role", "")
        secret = glue.deployment_secret(params.get("secret_file", ""))
        self._signer = TokenSigner(secret)
        self.version = int(args.get("model_version", 1) or 1)
        manifest = version_manifest(args)
        self.config = pool_config(params, args, manifest)
        self.loop, self.transport = build_instance(self.config, secret, args["model_name"], self.version)
        self.teardown_at_exit = self.transport is not None and self.transport.teardown_at_exit
        if manifest.probe is not None:  # before it serves: a wrong checkpoint fails its load
            try:
                tokenizer = Tokenizer(self.config.engine.model_dir)
                run_probe(self.loop.engine, tokenizer, manifest.probe, self.version)
            except BaseException:
                self._release()
                raise
        if self.config.engine.cores:  # the engine pinned its own threads; the stub's go along
            pin_process(self.config.engine.cores, skip=self.loop.loans.threads())
        self.loop.start()
        load_s = time.monotonic() - started
        self.reporter = PoolReporter(
            pb_utils,
            args["model_name"],
            args["model_instance_name"],
            self.loop,
            self.transport,
            self.version,
            load_s=load_s,
        ).start()
        log.info(
            "%s pool instance %s (version %d) ready after %.2f s",
            self.role,
            args["model_instance_name"],
            self.version,
            load_s,
        )

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._handle(request, sender)
            except Exception as exc:
                glue.send_error(self._pb, sender, classify(exc), tagged=True)
        return None

    def _handle(self, request: Any, sender: Any) -> None:
        pb = self._pb
        values = glue.input_arrays(pb, request, wire.POOL_INPUTS)
        control = glue.first_bytes(values["control"])
        # the token admits this one call: its job's handle, or its control message
        subject = wire.call_subject(glue.first_bytes(values["handle"]), control)
        token = glue.request_parameters(request).get(PARAMETER)
        refusal = self._signer.refusal(token, subject)
        if refusal is not None:
            self.reporter.refused(refusal)
            raise refused(refusal)
        if control is not None:
            load = self._control(wire.decode_control(control))
            final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            if load is None:
                sender.send(flags=final)
            else:
                outputs = [glue.bytes_tensor(pb, "event", wire.encode_load(load))]
                if self.config.role.exports_kv:
                    outputs.append(glue.bytes_tensor(pb, "descriptor", b""))
                sender.send(pb.InferenceResponse(output_tensors=outputs), flags=final)
            return
        sink = TritonSink(pb, sender, descriptor_output=self.config.role.exports_kv)
        job = wire.decode_job(self.config.role, values, sink)
        self.loop.validate(job)
        sink.accept()
        try:
            self.loop.submit(job)
        except ServingError as error:  # after the acceptance a failure is an event (see wire)
            sink.emit(Failed(error), final=True)

    def _control(self, control: Control) -> PoolLoad | None:
        """Act on a control request; a ping is answered with the pool's load."""
        if isinstance(control, Stop):  # a prefill pool's job after its prefill: its lease given back
            self.loop.stop(control.handle)
        elif not self.loop.healthy:  # Ping
            raise ServingError(UNAVAILABLE, f"{self.config.role.value} pool is not serving")
        else:
            return self.loop.stats().load()
        return None

    def finalize(self) -> None:
        # Finish what Triton already handed over and let exported KV be pulled before the memory
        # goes: bounded, since Triton's exit timeout bounds the whole unload. When the server is
        # exiting, it unloads only once every in-flight inference has ended, and it refuses new ones,
        # so no importer can come for a held lease (pools reach each other only inside this server):
        # waiting for it would only spend the exit timeout (a stream caught between its prefill and
        # its decode call at SIGTERM leaves one).
        server = ServerReadiness.from_environment()
        exiting = server is not None and server.server_exiting()
        if not self.loop.drain(min(self.config.kv.lease_ttl_s, DRAIN_TIMEOUT_S), leases=not exiting):
            log.warning(
                "%s pool instance unloads with work or KV leases still outstanding", self.config.role.value
            )
        self.reporter.retire()
        self._release()

    def _release(self) -> None:
        """Stop the engine loop and close the transport (its KV regions go with it)."""
        self.loop.shutdown()
        if self.transport is not None:
            self.transport.close()

    def abandon(self) -> None:
        """The server died without unloading us: unlink the KV regions (the process exits next).

        The engine may still hold views of them: their mappings then stay until the exit. The core
        loans' segments are unlinked too (their helper may still run: the process exits next)."""
        self.loop.loans.abandon()
        if self.transport is not None:
            self.transport.close()


def _default_model_dir() -> str:
    from disagg.paths import resolve_model_dir

    return str(resolve_model_dir())


def version_manifest(args: Mapping[str, Any]) -> Manifest:
    """The instance's version folder's manifest (``disagg.triton.version``)."""
    folder, version = args.get("model_repository", ""), args.get("model_version", "")
    if not folder or not str(version).strip():
        return Manifest()
    return read_manifest(folder, version)


def pool_config(
    params: Mapping[str, str], args: Mapping[str, Any], manifest: Manifest | None = None
) -> PoolConfig:
    """One instance's PoolConfig from its config.pbtxt parameters (strings, typed by
    ``PoolConfig.from_dict(strings=True)``) and what Triton's ``args`` say of the instance: its core set
    (``cores`` by instance index), for ``KIND_GPU`` its GPU, and its version folder's checkpoint
    (``manifest``). Raises ConfigError (a ValueError)."""
    settings: dict[str, Any] = {k: v for k, v in params.items() if k not in ADAPTER_KEYS}
    settings["role"] = params.get("role", "")
    cores = glue.parse_cores(params.get("cores", ""), args["model_instance_name"])
    if cores is not None:
        settings["cores"] = cores
    device = glue.instance_device(args)
    if device is not None:  # KIND_GPU: the GPU Triton placed this instance on
        settings["device"] = device
    if manifest is not None and manifest.checkpoint:
        settings["model_dir"] = manifest.checkpoint
    if not settings.get("model_dir"):
        settings["model_dir"] = _default_model_dir()
    return PoolConfig.from_dict(settings, strings=True)
