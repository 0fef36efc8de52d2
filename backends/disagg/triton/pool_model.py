"""Adapter of the pool roles (prefill, decode, colocated): requests in, engine-loop jobs out."""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any

import numpy as np

from disagg.engine.device import pin_process
from disagg.engine.engine import EngineConfig
from disagg.engine.sequence import Request
from disagg.serving.auth import PARAMETER, TokenSigner
from disagg.serving.errors import classify, invalid
from disagg.serving.loop import Event, Failed, Job
from disagg.serving.pool import PoolConfig, build_pool
from disagg.triton import glue, wire
from disagg.triton.metrics import PoolReporter

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 10.0  # within Triton's default exit timeout of the launcher (15 s)

# config.pbtxt parameters read by the adapter rather than by PoolConfig
ADAPTER_KEYS = ("role", "secret_file")


class TritonSink:
    """Job events -> responses of one Triton request (called from the engine-loop thread)."""

    def __init__(self, pb_utils: Any, sender: Any, descriptor_output: bool) -> None:
        self._pb = pb_utils
        self._sender = sender
        self._descriptor_output = descriptor_output

    def emit(self, event: Event, final: bool) -> None:
        pb = self._pb
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if isinstance(event, Failed):
            error = glue.triton_error(pb, event.error, tagged=True)
            self._sender.send(pb.InferenceResponse(error=error), flags=flags)
            return
        outputs = [glue.bytes_tensor(pb, "event", wire.encode_event(event))]
        if self._descriptor_output:
            outputs.append(glue.bytes_tensor(pb, "descriptor", getattr(event, "descriptor", None) or b""))
        self._sender.send(pb.InferenceResponse(output_tensors=outputs), flags=flags)

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled()


class PoolModel:
    def __init__(self, args: dict[str, Any], pb_utils: Any) -> None:
        self._pb = pb_utils
        params = glue.model_parameters(args)
        self.role = params.get("role", "")
        secret = glue.deployment_secret(params.get("secret_file", ""))
        self._signer = TokenSigner(secret)
        settings = {k: v for k, v in params.items() if k not in ADAPTER_KEYS and v != ""}
        settings = _typed(settings)
        settings["cores"] = glue.parse_cores(params.get("cores", ""), args["model_instance_name"])
        if settings["cores"] is None:
            del settings["cores"]
        device = glue.instance_device(args)
        if device is not None:  # KIND_GPU: the GPU Triton placed this instance on (NOT verified on a GPU)
            settings["device"] = device
        settings.setdefault("model_dir", _default_model_dir())
        self.config = PoolConfig.from_dict({"role": self.role, **settings})
        self.loop, self.transport = build_pool(self.config, secret)
        if self.config.engine.cores:  # the engine pinned its own threads; the stub's go along
            pin_process(self.config.engine.cores)
        self.loop.start()
        self.reporter = PoolReporter(
            pb_utils, args["model_name"], args["model_instance_name"], self.loop, self.transport
        ).start()
        log.info("%s pool instance %s ready", self.role, args["model_instance_name"])

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
        self._signer.check(glue.request_parameters(request).get(PARAMETER))
        values = glue.input_arrays(pb, request, wire.POOL_INPUTS)
        control = glue.first_bytes(values["control"])
        if control is not None:
            self._control(wire.decode_control(control))
            sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        handle = wire.decode_handle(glue.first_bytes(values["handle"]))
        sink = TritonSink(pb, sender, descriptor_output=self.role == "prefill")
        if self.role == "decode":
            descriptor = glue.first_bytes(values["descriptor"])
            state = glue.first_bytes(values["state"])
            if descriptor is None or state is None:
                raise invalid("decode requests need a KV descriptor and a sequence state")
            job = Job(handle, sink, state=wire.decode_state(state), descriptor=descriptor)
        else:
            ids, sampling = values["input_ids"], glue.first_bytes(values["sampling"])
            if ids is None or sampling is None:
                raise invalid(f"{self.role} requests need input_ids and sampling")
            prompt = tuple(int(t) for t in np.asarray(ids).reshape(-1))
            job = Job(handle, sink, request=Request(prompt, wire.decode_sampling(sampling)))
        self.loop.validate(job)
        self.loop.submit(job)

    def _control(self, control: dict[str, Any]) -> None:
        if control["op"] == "stop":
            self.loop.stop(str(control.get("handle", "")))
        elif self.role == "prefill":
            self.loop.abort_lease(str(control.get("lease_id", "")))

    def finalize(self) -> None:
        # Finish what Triton already handed over and let exported KV be pulled before the memory
        # goes: bounded, since Triton's exit timeout bounds the whole unload.
        if not self.loop.drain(min(self.config.lease_ttl_s, DRAIN_TIMEOUT_S)):
            log.warning("%s pool instance unloads with work or KV leases still outstanding", self.role)
        self.reporter.retire()
        self.loop.shutdown()
        if self.transport is not None:
            self.transport.close()

    def abandon(self) -> None:
        """The server died without unloading us: unlink the KV regions (the process exits next).

        The engine may still hold views of them: their mappings then stay until the exit."""
        if self.transport is not None:
            self.transport.close()


def _default_model_dir() -> str:
    from disagg.paths import resolve_model_dir

    return str(resolve_model_dir())


def _field_types() -> dict[str, str]:
    """Setting name -> annotation text, from the config dataclasses themselves (no list to keep in step)."""
    return {f.name: str(f.type) for cls in (PoolConfig, EngineConfig) for f in fields(cls)}


def _typed(settings: dict[str, str]) -> dict[str, Any]:
    """config.pbtxt parameters are strings: convert each to its config field's scalar type."""
    types = _field_types()
    out: dict[str, Any] = {}
    for key, value in settings.items():
        kind = types.get(key, "str").split("|")[0].strip()
        try:
            if kind == "int":
                out[key] = int(value)
            elif kind == "float":
                out[key] = float(value)
            elif kind == "bool":
                out[key] = value.strip().lower() in ("1", "true", "yes")
            else:
                out[key] = value
        except ValueError:
            raise ValueError(f"parameter {key}={value!r} is not a number") from None
    return out
