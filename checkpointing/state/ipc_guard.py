"""Checks on an Arrow IPC record batch message *before* pyarrow decodes it.

pyarrow decompresses a compressed record batch while decoding it, to whatever size its buffers
claim, so a few kilobytes of a planted snapshot can ask for gigabytes. The snapshot writer never
compresses (:mod:`checkpointing.state.snapshot`), so the reader refuses any compressed batch unread.
Whether a batch is compressed is only written in the message's flatbuffer header
(``RecordBatch.compression``, Arrow's ``Message.fbs``); pyarrow does not expose it, so this
module reads those few fields itself. Nothing here allocates more than the header's size.
"""

from __future__ import annotations

import struct

#: ``Message`` table fields (vtable slots): version, header_type, header, bodyLength, ...
_MESSAGE_HEADER_TYPE = 1
_MESSAGE_HEADER = 2
#: ``MessageHeader`` union member of a record batch
_RECORD_BATCH = 3
#: ``RecordBatch`` table fields: length, nodes, buffers, compression, ...
_RECORD_BATCH_COMPRESSION = 3


class MalformedHeader(ValueError):
    """The message header is not a well-formed flatbuffer."""


def is_compressed_record_batch(metadata: bytes | memoryview) -> bool:
    """Whether the flatbuffer ``Message`` header ``metadata`` is a record batch with a
    ``compression`` field. Raises :class:`MalformedHeader` on offsets outside the header."""
    buf = memoryview(metadata).cast("B")
    try:
        root = _u32(buf, 0)
        kind = _field(buf, root, _MESSAGE_HEADER_TYPE)
        if kind is None or buf[kind] != _RECORD_BATCH:
            return False
        header = _field(buf, root, _MESSAGE_HEADER)
        if header is None:
            raise MalformedHeader("record batch message without a header")
        table = header + _u32(buf, header)
        return _field(buf, table, _RECORD_BATCH_COMPRESSION) is not None
    except (struct.error, IndexError) as exc:
        raise MalformedHeader(f"malformed message header ({exc})") from None


def _u32(buf: memoryview, pos: int) -> int:
    if pos < 0:
        raise IndexError(f"offset {pos} before the header")
    value: int = struct.unpack_from("<I", buf, pos)[0]
    return value


def _field(buf: memoryview, table: int, slot: int) -> int | None:
    """Absolute position of field ``slot`` of the table at ``table``, None when absent."""
    if table < 0:
        raise IndexError(f"table offset {table} before the header")
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    if vtable < 0:
        raise IndexError(f"vtable offset {vtable} before the header")
    vtable_size = struct.unpack_from("<H", buf, vtable)[0]
    entry = 4 + 2 * slot
    if entry + 2 > vtable_size:
        return None
    offset = struct.unpack_from("<H", buf, vtable + entry)[0]
    if not offset:
        return None
    if table + offset >= len(buf):
        raise IndexError(f"field at {table + offset} beyond the header")
    return table + offset
