"""Named fault points of a hand-off. The default hooks do nothing.

``faulty.FaultyTransport`` installs hooks that delay, fail midway, corrupt or drop acks;
nothing else should. Each point is called by ``Transport.import_blocks`` in this order:
``before_copy`` -> (per run) ``after_run`` -> ``after_copy``; ``deliver_ack`` decides
whether the importer's ack is sent at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from disagg.kv.descriptor import Descriptor


class TransferHooks:
    def before_copy(self, desc: Descriptor) -> None:
        """Called after verification, before the first byte moves."""

    def after_run(self, index: int, total: int) -> None:
        """Called after run ``index`` of ``total`` has been copied; raising leaves later runs uncopied."""

    def after_copy(self, desc: Descriptor, dest: torch.Tensor, dest_ids: Sequence[int]) -> None:
        """Called when all bytes have arrived, before the checksum is checked."""

    def deliver_ack(self, desc: Descriptor) -> bool:
        """Whether the importer sends its ack (natively and in the result)."""
        return True
