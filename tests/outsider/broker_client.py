"""A client of vmmt's fd broker, from docs/broker.md alone (protocol 3)."""

import array
import os
import select
import socket
import struct
import time

from desc import EINVAL, EPERM, EPROTO, ETIMEDOUT, ECLOSED, Refused

REQ_MAGIC = b"VMBQ"
REP_MAGIC = b"VMBR"
MSG_MAGIC = b"VMBM"
VERSION = 3
HOLD = 1
HELD = 1
LINK_HOLD, LINK_BYE = 1, 2
ESYS = -13


def chunk_id(pool_id, k):
    b = bytearray(pool_id)
    v = (k + 1) & 0xFFFFFFFF
    for i in range(4):
        b[12 + i] ^= (v >> (8 * i)) & 0xFF
    return bytes(b)


def sock_address(d):
    name = bytes(d.broker_name[:d.broker_len])
    if d.broker_kind == 0:
        return b"\0" + name
    return name


def fmt_address(d):
    name = bytes(d.broker_name[:d.broker_len])
    return ("@" if d.broker_kind == 0 else "") + name.decode("latin-1")


def own_pidns():
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _close_all(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def fetch_fds(d, want_id, nfds, hold, timeout_ms=2000):
    """Returns (fds, link_socket_or_None). Raises Refused."""
    if not 1 <= nfds <= 4:
        raise Refused(EINVAL, "fd count")
    deadline = time.monotonic() + (timeout_ms or 2000) / 1000.0
    addr = sock_address(d)
    where = fmt_address(d)
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET
                          | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            res = _exchange(s, d, addr, where, want_id, nfds, hold, deadline)
        except BaseException:
            s.close()
            raise
        if res is None:  # closed without a reply: retry after 5 ms
            s.close()
            if time.monotonic() + 0.005 > deadline:
                raise Refused(ECLOSED, f"{where} closed the connection without a reply")
            time.sleep(0.005)
            continue
        fds, held = res
        if held and hold:  # HELD without HOLD is ignored
            return fds, s
        s.close()
        return fds, None


def _connect(s, addr, where, deadline):
    while True:
        try:
            s.connect(addr)
            return
        except BlockingIOError as e:
            # EAGAIN: listener backlog full; EINPROGRESS does not happen on AF_UNIX
            if time.monotonic() + 0.005 > deadline:
                raise Refused(ETIMEDOUT, f"connect to {where} timed out") from e
            time.sleep(0.005)
        except (PermissionError,) as e:
            raise Refused(EPERM, f"cannot connect to {where}: {e}") from e
        except OSError as e:
            raise Refused(ESYS, f"cannot connect to {where}: {e}") from e


def _authenticate(s, d, where):
    cred = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    pid, uid, _gid = struct.unpack("<iII", cred)
    if uid != d.producer_uid:
        raise Refused(EPERM, f"the server at {where} is not the producer: uid {uid}"
                      f" pid {pid}, the descriptor names uid {d.producer_uid}")
    mine = own_pidns()
    if mine is not None and d.producer_pidns == mine and d.producer_pid != 0:
        if pid != d.producer_pid:
            raise Refused(EPERM, f"the server at {where} is not the producer: pid {pid}"
                          f", the descriptor names pid {d.producer_pid}")
    return pid


def _exchange(s, d, addr, where, want_id, nfds, hold, deadline):
    _connect(s, addr, where, deadline)
    _authenticate(s, d, where)
    req = REQ_MAGIC + struct.pack("<HH", VERSION, HOLD if hold else 0) + bytes(want_id)
    assert len(req) == 24
    try:
        s.send(req)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused at accept: read its refusal
    reset_seen = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Refused(ETIMEDOUT, f"no reply from {where}")
        r, _, _ = select.select([s], [], [], left)
        if not r:
            continue
        try:
            data, anc, flags, _ = s.recvmsg(
                256, socket.CMSG_SPACE(8 * 4), socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            continue
        except ConnectionResetError:
            if reset_seen:
                return None
            reset_seen = True
            continue
        break
    fds = []
    for level, typ, cdata in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(cdata[:len(cdata) - (len(cdata) % a.itemsize)])
            fds.extend(a)
    try:
        return _check_reply(data, flags, fds, want_id, nfds, where)
    except BaseException:
        _close_all(fds)
        raise


def _check_reply(data, flags, fds, want_id, nfds, where):
    if len(data) == 0:
        return None
    if flags & socket.MSG_TRUNC or len(data) < 14 or data[0:4] != REP_MAGIC:
        raise Refused(EPROTO, f"malformed reply from {where}")
    ver = struct.unpack_from("<H", data, 4)[0]
    if ver != VERSION:
        raise Refused(EPROTO, f"{where} speaks broker protocol version {ver}, this speaks 3")
    msg_len = struct.unpack_from("<H", data, 12)[0]
    if msg_len > 200 or len(data) != 30 + msg_len:
        raise Refused(EPROTO, f"malformed reply length from {where}")
    status = struct.unpack_from("<i", data, 8)[0]
    if not -15 <= status <= 0:
        raise Refused(EPROTO, f"unknown status {status} from {where}")
    if status != 0:
        msg = "".join(chr(c) if 32 <= c < 127 else "?" for c in data[30:30 + msg_len])
        _close_all(fds)
        raise Refused(status, f"broker refused: {msg}")
    if data[14:30] != bytes(want_id):
        raise Refused(EPROTO, f"{where} serves another pool")
    if flags & socket.MSG_CTRUNC and not fds:
        raise Refused(EPROTO, "broker returned no file descriptor")
    announced = data[6]
    if not 1 <= announced <= 4 or announced != len(fds):
        raise Refused(EPROTO, f"{where} announced {announced} fd(s) but {len(fds)} arrived")
    if len(fds) != nfds:
        raise Refused(EPROTO, f"broker returned {len(fds)} fd(s), expected {nfds}")
    held = bool(data[7] & HELD)
    return fds, held


def link_send(sock, typ, first, count):
    msg = MSG_MAGIC + struct.pack("<HHII", VERSION, typ, first, count)
    assert len(msg) == 16
    sock.send(msg)
