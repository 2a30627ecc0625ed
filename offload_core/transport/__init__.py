"""How weights move, one file per mechanism; every transport's ``apply`` and ``remove`` are
exactly symmetric, which is what makes "release leaves nothing behind" checkable."""

from .base import Transport, TransportContext
from .leaf import LeafGroupTransport
from .on_demand import OnDemandTransport
from .resident import ResidentTransport
from .streamer import BlockStreamer

__all__ = [
    "BlockStreamer",
    "LeafGroupTransport",
    "OnDemandTransport",
    "ResidentTransport",
    "Transport",
    "TransportContext",
]
