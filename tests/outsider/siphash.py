"""SipHash-2-4 (Aumasson and Bernstein, 2012), 64-bit output, written from
the paper's definition: the key's two halves and the message words are read
little-endian, and the output u64 is v0^v1^v2^v3 after the finalization."""

import struct

M64 = 0xFFFFFFFFFFFFFFFF


def _rotl(x, b):
    return ((x << b) | (x >> (64 - b))) & M64


def _round(v0, v1, v2, v3):
    v0 = (v0 + v1) & M64
    v1 = _rotl(v1, 13)
    v1 ^= v0
    v0 = _rotl(v0, 32)
    v2 = (v2 + v3) & M64
    v3 = _rotl(v3, 16)
    v3 ^= v2
    v0 = (v0 + v3) & M64
    v3 = _rotl(v3, 21)
    v3 ^= v0
    v2 = (v2 + v1) & M64
    v1 = _rotl(v1, 17)
    v1 ^= v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


def siphash24(key, data):
    if len(key) != 16:
        raise ValueError("SipHash key is 16 bytes")
    k0, k1 = struct.unpack("<QQ", key)
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573
    n = len(data)
    end = n - (n % 8)
    for i in range(0, end, 8):
        m = int.from_bytes(data[i:i + 8], "little")
        v3 ^= m
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
        v0 ^= m
    tail = bytes(data[end:]) + bytes(7 - (n % 8))
    m = int.from_bytes(tail, "little") | ((n & 0xFF) << 56)
    v3 ^= m
    v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    v0 ^= m
    v2 ^= 0xFF
    for _ in range(4):
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


def _selftest():
    # The paper's appendix A test vector: key 00..0f, message 00..0e.
    key = bytes(range(16))
    msg = bytes(range(15))
    assert siphash24(key, msg) == 0xA129CA6149BE45E5, hex(siphash24(key, msg))


_selftest()
