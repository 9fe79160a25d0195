"""Disaggregated prefill/decode over Mooncake's transfer engine: the producer pushes KV to the consumer.

``MooncakePeerTransport`` is the ``PeerTransport`` port; ``PDProducer`` and ``PDConsumer`` are one rank
of a prefill and of a decode engine, talking over a msgpack side channel and writing through any
``PeerTransport``; ``RankSpec`` describes a rank. See ``docs/pd.md``.
"""

from __future__ import annotations

from kvcore_mooncake.pd.consumer import PDConsumer, ReceivedTransfer
from kvcore_mooncake.pd.offers import FreedTransfer, FreeReason
from kvcore_mooncake.pd.producer import PDProducer
from kvcore_mooncake.pd.side_channel import listen_port
from kvcore_mooncake.pd.spec import RankSpec
from kvcore_mooncake.pd.transport import MooncakePeerTransport

__all__ = [
    "FreeReason",
    "FreedTransfer",
    "MooncakePeerTransport",
    "PDConsumer",
    "PDProducer",
    "RankSpec",
    "ReceivedTransfer",
    "listen_port",
]
