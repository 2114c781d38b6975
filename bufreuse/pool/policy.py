"""Release policies of a pool buffer."""

from __future__ import annotations

import enum

__all__ = ["Policy"]


class Policy(enum.StrEnum):
    """How a buffer kind is provided and handed back.

    ``RING``: N persistent slots, GPU-side waits, no allocator traffic (persistent bytes = N x bound).
    ``RECORD_STREAM``: ``torch.empty`` + ``record_stream`` (the control; pending-free blocks pile up).
    ``STREAM_ORDERED``: ``torch.empty``; release makes the producer stream wait on the consumer (PR 6883).
    """

    RING = "ring"
    RECORD_STREAM = "record-stream"
    STREAM_ORDERED = "stream-ordered"
