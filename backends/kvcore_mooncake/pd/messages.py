"""The side channel's wire format: typed msgpack messages (msgspec), never pickle.

Requests (``Hello``, ``Pull``, ``Release``, ``Notice``) and replies (``Welcome``, ``Ack``, ``Refused``)
are tagged structs; decoding checks every field's type, and a message that does not decode is refused,
never guessed at. ``RankInfo`` is what a rank says about itself in a handshake: who it is, where its
transfer engine listens, where its KV lives, and the fingerprint both sides must share.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from kvcore.errors import BackendError

__all__ = [
    "PROTOCOL_VERSION",
    "Ack",
    "Fingerprint",
    "Hello",
    "LayoutInfo",
    "Notice",
    "Pull",
    "RankInfo",
    "Refused",
    "Release",
    "Reply",
    "Request",
    "Welcome",
    "decode_reply",
    "decode_request",
    "encode",
]

PROTOCOL_VERSION = 3


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What must match for KV to be exchangeable at all, whatever the TP sizes."""

    model: str
    dtype: str
    layout: str  # the layout kind and, where it matters, the head order: "flash_attn/hnd"
    block_tokens: int
    total_kv_heads: int
    head_size: int
    num_layers: int
    # a recurrent state beside the KV (``kvcore.model.state_plan.StateLayout``): its name and its parts'
    # (units, unit_bytes) over every rank; "" and () for a model without states
    state: str = ""
    state_parts: tuple[tuple[int, int], ...] = ()


class LayoutInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A ``kvcore.model.layout.KVLayout`` as plain fields."""

    kind: str
    num_blocks: int
    block_tokens: int
    num_kv_heads: int
    head_size: int
    dtype_size: int
    head_order: str
    packing: str
    page_bytes: int | None


class RankInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank of one engine: identity, endpoints, KV geometry and memory (one base per layer)."""

    version: int
    engine_id: str
    tp_size: int
    tp_rank: int
    rpc_address: str  # the transfer engine, "host:port"
    side_channel: str  # this rank's side channel, "tcp://host:port"
    fingerprint: Fingerprint
    layout: LayoutInfo
    layer_bases: tuple[int, ...]


class Hello(msgspec.Struct, frozen=True, tag="hello", forbid_unknown_fields=True):
    """Consumer -> producer: a handshake. Answered by ``Welcome`` or ``Refused``."""

    info: RankInfo


class Pull(msgspec.Struct, frozen=True, tag="pull", forbid_unknown_fields=True):
    """Consumer -> producer: push ``src_blocks[i]`` into my ``dst_blocks[i]`` for ``transfer_id``, and the
    recurrent states of ``state_src_blocks[i]`` into my ``state_dst_blocks[i]`` (a hybrid SSM model's
    blocks of its state groups, which split over TP ranks unlike heads)."""

    transfer_id: str
    engine_id: str
    tp_rank: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    state_src_blocks: tuple[int, ...] = ()
    state_dst_blocks: tuple[int, ...] = ()

    @property
    def all_src_blocks(self) -> tuple[int, ...]:
        return self.src_blocks + self.state_src_blocks


class Release(msgspec.Struct, frozen=True, tag="release", forbid_unknown_fields=True):
    """Consumer -> producer: this consumer rank needs nothing more of ``transfer_id`` (or gave up)."""

    transfer_id: str
    engine_id: str
    tp_rank: int


class Notice(msgspec.Struct, frozen=True, tag="notice", forbid_unknown_fields=True):
    """Producer -> consumer: my writes for ``transfer_id`` are done (``ok``) or failed. Idempotent."""

    transfer_id: str
    engine_id: str
    tp_rank: int
    ok: bool
    reason: str = ""


class Welcome(msgspec.Struct, frozen=True, tag="welcome", forbid_unknown_fields=True):
    info: RankInfo


class Ack(msgspec.Struct, frozen=True, tag="ack", forbid_unknown_fields=True):
    pass


class Refused(msgspec.Struct, frozen=True, tag="refused", forbid_unknown_fields=True):
    reason: str


Request: TypeAlias = Hello | Pull | Release | Notice
Reply: TypeAlias = Welcome | Ack | Refused

_encoder = msgspec.msgpack.Encoder()
# A union is not a ``type[T]``: without the annotations mypy would type the decoders as returning Any.
_requests: msgspec.msgpack.Decoder[Request] = msgspec.msgpack.Decoder(Request)
_replies: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)


def encode(message: Request | Reply) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> Request:
    """Raises ``BackendError`` for bytes that are not a well-formed request."""
    try:
        return _requests.decode(data)
    except msgspec.DecodeError as exc:
        raise BackendError(f"malformed side-channel request: {exc}") from exc


def decode_reply(data: bytes) -> Reply:
    """Raises ``BackendError`` for bytes that are not a well-formed reply."""
    try:
        return _replies.decode(data)
    except msgspec.DecodeError as exc:
        raise BackendError(f"malformed side-channel reply: {exc}") from exc
