"""The 512-byte descriptor, version 2, decoded and checked from
docs/descriptor.md ("Layout", "Rules a decoder enforces") alone."""

import struct

from siphash import siphash24

DESC_SIZE = 512
MAGIC = b"VMMTDESC"
VERSION = 2

HT_POSIX_FD = 1
HT_FABRIC = 8

F_STREAM_ORDERED = 1 << 0
F_PACKED = 1 << 1
F_HOST_TABLE = 1 << 2
F_TOKEN = 1 << 3
F_KNOWN = F_STREAM_ORDERED | F_PACKED | F_HOST_TABLE | F_TOKEN

# vmmt_status values (include/vmmt.h)
EINVAL, EPROTO, ESTATE, ECLOSED, ETIMEDOUT, EPERM = -1, -11, -14, -10, -8, -12

# (offset, size) of every reserved run of the layout table
RESERVED = [(20, 4), (214, 2), (316, 4), (400, 80), (500, 12)]
SEAL_OFF = 392


class Refused(Exception):
    def __init__(self, status, msg):
        super().__init__(msg)
        self.status = status


def _u(b, off, fmt):
    return struct.unpack_from("<" + fmt, b, off)[0]


def _inside(a_off, a_len, b_off, b_end):
    """[a_off, a_off + a_len) inside [b_off, b_end], by differences."""
    if a_off < b_off or a_off > b_end:
        return False
    return a_len <= b_end - a_off


class Desc:
    """Fields by the names of the layout table."""

    def __init__(self, raw):
        self.raw = bytes(raw)


def decode(raw):
    raw = bytes(raw)
    if len(raw) != DESC_SIZE:
        raise Refused(EPROTO, f"descriptor is {len(raw)} bytes, not 512")
    d = Desc(raw)
    if raw[0:8] != MAGIC:
        raise Refused(EPROTO, "magic")
    d.version = _u(raw, 8, "H")
    if d.version != VERSION:
        raise Refused(EPROTO, f"version {d.version}, this reader reads 2")
    d.size = _u(raw, 10, "H")
    if d.size != DESC_SIZE:
        raise Refused(EPROTO, "size")
    for off, n in RESERVED:
        if any(raw[off:off + n]):
            raise Refused(EPROTO, f"reserved bytes at {off}")
    d.handle_type = _u(raw, 12, "I")
    d.flags = _u(raw, 16, "I")
    d.pool_id = raw[24:40]
    d.fabric = raw[40:104]
    d.broker_kind = raw[104]
    d.broker_len = raw[105]
    d.broker_name = raw[106:214]
    d.producer_device = _u(raw, 216, "i")
    d.producer_pid = _u(raw, 220, "i")
    d.consumer_count = _u(raw, 224, "I")
    d.table_slots = _u(raw, 228, "I")
    d.alloc_size = _u(raw, 232, "Q")
    d.table_offset = _u(raw, 240, "Q")
    d.slot_stride = _u(raw, 248, "I")
    d.producer_uid = _u(raw, 252, "I")
    d.data_offset = _u(raw, 256, "Q")
    d.slot = _u(raw, 264, "I")
    d.generation = _u(raw, 268, "I")
    d.slice_offset = _u(raw, 272, "Q")
    d.slice_bytes = _u(raw, 280, "Q")
    d.offset = _u(raw, 288, "Q")
    d.nbytes = _u(raw, 296, "Q")
    d.pack_index = _u(raw, 304, "H")
    d.pack_count = _u(raw, 306, "H")
    d.dtype_code = raw[308]
    d.dtype_bits = raw[309]
    d.dtype_lanes = _u(raw, 310, "H")
    d.ndim = _u(raw, 312, "I")
    d.shape = list(struct.unpack_from("<8q", raw, 320))
    d.producer_pidns = _u(raw, 384, "Q")
    d.seal = _u(raw, SEAL_OFF, "Q")
    d.chunk_size = _u(raw, 480, "Q")
    d.chunk = _u(raw, 488, "I")
    d.incarnation = _u(raw, 492, "I")
    d.memory_location = _u(raw, 496, "I")

    if not any(d.pool_id):
        raise Refused(EPROTO, "pool_id is all zero")
    if d.handle_type not in (HT_POSIX_FD, HT_FABRIC):
        raise Refused(EPROTO, "handle_type")
    if d.flags & ~F_KNOWN:
        raise Refused(EPROTO, "flags: unknown bits")
    if d.table_offset != 64:
        raise Refused(EPROTO, "table_offset is not 64")
    host_table = bool(d.flags & F_HOST_TABLE)
    if d.handle_type == HT_FABRIC:
        if host_table:
            raise Refused(EPROTO, "HOST_TABLE on a FABRIC descriptor")
        if not any(d.fabric):
            raise Refused(EPROTO, "fabric all zero")
        if any(raw[104:214]):
            raise Refused(EPROTO, "broker bytes on a FABRIC descriptor")
    else:
        if any(d.fabric):
            raise Refused(EPROTO, "fabric bytes on a POSIX_FD descriptor")
        if d.broker_kind not in (0, 1):
            raise Refused(EPROTO, "broker.kind")
        if not 1 <= d.broker_len <= 107:
            raise Refused(EPROTO, "broker.len")
        if any(d.broker_name[d.broker_len:]):
            raise Refused(EPROTO, "broker.name bytes past len")
        if d.broker_kind == 1 and 0 in d.broker_name[:d.broker_len]:
            raise Refused(EPROTO, "broker path with a NUL")
    if d.producer_device < 0 or d.producer_pid < 0:
        raise Refused(EPROTO, "producer_device or producer_pid negative")
    if not 1 <= d.consumer_count <= 256:
        raise Refused(EPROTO, "consumer_count")
    if d.table_slots == 0 or d.table_slots > (1 << 20):
        raise Refused(EPROTO, "table_slots")
    if d.slot_stride % 4 or d.slot_stride < 4 * (1 + d.consumer_count):
        raise Refused(EPROTO, "slot_stride")
    rows_end = d.table_offset + d.table_slots * d.slot_stride  # 64-bit, no wrap
    if host_table:
        if d.data_offset > d.alloc_size:
            raise Refused(EPROTO, "data_offset above alloc_size")
    else:
        if rows_end > d.alloc_size:
            raise Refused(EPROTO, "control table does not fit the allocation")
        if d.data_offset < rows_end or d.data_offset > d.alloc_size:
            raise Refused(EPROTO, "data_offset")
    if d.slot >= d.table_slots:
        raise Refused(EPROTO, "slot")
    if d.generation % 4 != 1 or d.generation < 5:
        raise Refused(EPROTO, "generation")
    if not _inside(d.slice_offset, d.slice_bytes, d.data_offset, d.alloc_size):
        raise Refused(EPROTO, "slice outside the data region")
    if not _inside(d.offset, d.nbytes, d.slice_offset,
                   d.slice_offset + d.slice_bytes):
        raise Refused(EPROTO, "buffer outside its slice")
    if d.pack_count == 0 or d.pack_count > 64:
        raise Refused(EPROTO, "pack_count")
    if d.pack_index >= d.pack_count:
        raise Refused(EPROTO, "pack_index")
    if bool(d.flags & F_PACKED) != (d.pack_count > 1):
        raise Refused(EPROTO, "PACKED flag and pack_count disagree")
    if d.ndim > 8:
        raise Refused(EPROTO, "ndim")
    for i in range(8):
        if i < d.ndim and d.shape[i] < 0:
            raise Refused(EPROTO, f"shape[{i}] negative")
        if i >= d.ndim and d.shape[i] != 0:
            raise Refused(EPROTO, f"shape[{i}] past ndim")
    if d.dtype_bits == 0:
        if d.dtype_code or d.dtype_lanes:
            raise Refused(EPROTO, "untyped with dtype_code or lanes")
    else:
        if d.dtype_lanes == 0:
            raise Refused(EPROTO, "dtype_lanes 0")
        t = 1
        lim = (1 << 64) - 1
        for i in range(d.ndim):
            t *= d.shape[i]
            if t > lim:
                raise Refused(EPROTO, "tensor bit count overflows")
        t *= d.dtype_bits * d.dtype_lanes
        if t > lim:
            raise Refused(EPROTO, "tensor bit count overflows")
        want = t // 8 + (t % 8 != 0)
        if d.nbytes != want:
            raise Refused(EPROTO, f"nbytes {d.nbytes} != {want}")
        esize = (d.dtype_bits * d.dtype_lanes + 7) // 8
        align = 1
        while align < esize:
            align *= 2
        align = min(align, 256)
        if d.offset % align:
            raise Refused(EPROTO, "offset not aligned to the element")
    if d.memory_location > 1:
        raise Refused(EPROTO, "memory_location")
    if d.memory_location == 1 and not (d.handle_type == HT_POSIX_FD and host_table):
        raise Refused(EPROTO, "host pool without POSIX_FD and HOST_TABLE")
    if d.chunk_size == 0:
        if d.chunk or d.incarnation:
            raise Refused(EPROTO, "chunk fields on a fixed pool")
    else:
        if not (d.handle_type == HT_POSIX_FD and host_table):
            raise Refused(EPROTO, "elastic pool without POSIX_FD and HOST_TABLE")
        if d.chunk_size % 4096 or d.alloc_size % d.chunk_size:
            raise Refused(EPROTO, "chunk_size")
        if d.chunk != d.offset // d.chunk_size:
            raise Refused(EPROTO, "chunk is not offset / chunk_size")
        if d.incarnation == 0:
            raise Refused(EPROTO, "incarnation 0")
    return d


def seal_of(raw, key):
    b = bytearray(raw)
    b[SEAL_OFF:SEAL_OFF + 8] = bytes(8)
    return siphash24(key, bytes(b))


def check_seal(d, key):
    if seal_of(d.raw, key) != d.seal:
        raise Refused(EPROTO, "seal does not match the pool's key")


SAME_POOL = ["pool_id", "handle_type", "fabric", "broker_kind", "broker_len",
             "broker_name", "producer_device", "producer_pid", "producer_uid",
             "producer_pidns", "consumer_count", "alloc_size", "table_offset",
             "table_slots", "slot_stride", "data_offset", "chunk_size",
             "memory_location"]


def check_same_pool(d, first):
    mask = ~(F_PACKED | F_TOKEN)
    if (d.flags & mask) != (first.flags & mask):
        raise Refused(EPROTO, "flags differ from the pool's first descriptor")
    for f in SAME_POOL:
        if getattr(d, f) != getattr(first, f):
            raise Refused(EPROTO, f"{f} differs from the pool's first descriptor")


def parse_pool_record(rec):
    """The 64-byte pool record (descriptor.md, "The control table")."""
    if len(rec) != 64 or rec[0:4] != b"POOL":
        raise Refused(EPROTO, "pool record: no POOL magic")
    slots, stride, count = struct.unpack_from("<III", rec, 4)
    pool_id = rec[16:32]
    toff, doff = struct.unpack_from("<QQ", rec, 32)
    key = rec[48:64]
    return dict(table_slots=slots, slot_stride=stride, consumer_count=count,
                pool_id=pool_id, table_offset=toff, data_offset=doff, key=key)


def check_pool_record(rec, d):
    r = parse_pool_record(rec)
    for f in ("pool_id", "table_slots", "slot_stride", "consumer_count",
              "table_offset", "data_offset"):
        if r[f] != getattr(d, f):
            raise Refused(EPROTO, f"pool record's {f} differs from the descriptor")
    return r["key"]
