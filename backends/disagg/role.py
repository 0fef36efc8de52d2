"""The serving roles of a pool instance and the operations each accepts. Torch-free."""

from __future__ import annotations

from enum import Enum


class Operation(str, Enum):
    """One kind of job a pool can run."""

    PREFILL = "prefill"  # prefill a prompt, export its KV under a lease, return the first token
    DECODE = "decode"  # import a prefilled sequence's KV and decode it to its end
    GENERATE = "generate"  # both phases in this pool (colocated)


class Role(str, Enum):
    """What a pool instance is deployed as (the ``role`` parameter of its model)."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    @property
    def operations(self) -> frozenset[Operation]:
        """The operations a pool of this role accepts by default."""
        return _OPERATIONS[self]

    @property
    def exports_kv(self) -> bool:
        return self is Role.PREFILL

    @property
    def needs_transport(self) -> bool:
        return self in (Role.PREFILL, Role.DECODE)

    @classmethod
    def parse(cls, value: str | Role) -> Role:
        """The role named ``value``; ValueError naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"role must be one of {[r.value for r in cls]}, got {value!r}") from None


_OPERATIONS = {
    Role.PREFILL: frozenset({Operation.PREFILL}),
    Role.DECODE: frozenset({Operation.DECODE}),
    Role.COLOCATED: frozenset({Operation.GENERATE}),
}
