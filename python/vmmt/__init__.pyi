from typing import (Any, Dict, Iterable, List, Literal, Optional, Protocol, Sequence, Tuple,
                    TypedDict, TypeVar, Union, overload)

__version__: str
ALL_RANKS: Literal["all"]

# The library's statuses (vmmt.h's vmmt_status), also the `status` of every exception.
OK: int
EINVAL: int
ENODRIVER: int
ENODEV: int
ENOTSUP: int
ECUDA: int
ENOMEM: int
EFULL: int
ETIMEDOUT: int
EFAILED: int
ECLOSED: int
EPROTO: int
EPERM: int
ESYS: int
ESTATE: int
ETOOBIG: int
STATUSES: Dict[str, int]

class Error(RuntimeError):
    status: int

class NoRoom(Error):
    """No room for this buffer: send it another way."""
class PoolFull(NoRoom):
    """Full now (EFULL): retry later, or fall back."""
class TooLarge(NoRoom):
    """Can never fit this pool (ETOOBIG)."""
class Closed(Error):
    """The pool or consumer is closed or shut down (ECLOSED)."""
class Stale(Error):
    """Already consumed or acknowledged for these ranks, cancelled, or recycled (ESTATE)."""
class ProducerGone(Error):
    """The producer died, or shut its pool down, before the bytes were there."""
class Timeout(Error, TimeoutError): ...

class _DLPackArray(Protocol):
    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...

_Out = TypeVar("_Out", bound=_DLPackArray)

# An int (CUstream), or an object with cuda_stream / __cuda_stream__ / ptr.
StreamLike = Any
# One rank, consecutive ranks, or ALL_RANKS; required by consume and ack.
Ranks = Union[int, Iterable[int], Literal["all"]]

def select_driver(name: Literal["cuda", "emu"]) -> None: ...
def driver_name() -> str: ...
def device_count() -> int: ...
def probe(device: Optional[int] = ...) -> Dict[str, Any]: ...
def log_to_logging() -> None: ...
def log_to_stderr() -> None: ...

class Descriptor(bytes):
    def __new__(cls, data: Union[bytes, bytearray, memoryview]) -> "Descriptor": ...
    @classmethod
    def from_bytes(cls, data: Union[bytes, bytearray, memoryview]) -> "Descriptor": ...
    @property
    def pool_id(self) -> bytes: ...
    @property
    def handle_type(self) -> str: ...
    @property
    def producer_device(self) -> int: ...
    @property
    def consumer_count(self) -> int: ...
    @property
    def slot(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def dl_dtype(self) -> Tuple[int, int, int]: ...
    @property
    def dtype(self) -> Optional[str]: ...
    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def ndim(self) -> int: ...
    @property
    def stream_ordered(self) -> bool: ...
    @property
    def pack_index(self) -> int: ...
    @property
    def pack_count(self) -> int: ...

class Buffer:
    """A consumed buffer in device memory; pass it to from_dlpack()."""
    ptr: int
    nbytes: int
    device: int
    stream: int
    shape: Tuple[int, ...]
    dl_dtype: Tuple[int, int, int]
    def __dlpack__(self, stream: Optional[int] = ..., *, max_version: Optional[Tuple[int, int]] = ...,
                   dl_device: Optional[Tuple[int, int]] = ..., copy: Optional[bool] = ...) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    def synchronize(self) -> None: ...

class PoolStats(TypedDict):
    """Every field of vmmt_pool_stats (python/src/pool_stats.c, stat_fields)."""
    handle_type: str
    handoff: str
    fell_back_to_posix: bool
    host_control_table: bool
    allocation_size: int
    table_bytes: int
    data_bytes: int
    slots: int
    in_flight: int
    in_flight_bytes: int
    published: int
    recycled: int
    cancelled: int
    full: int
    reclaims: int
    broker_served: int
    broker_refused: int
    memory_location: str
    device_bytes: int
    host_bytes: int
    resident_bytes: int
    peak_bytes: int
    max_bytes: int
    chunk_bytes: int
    chunks_made: int
    chunks_released: int
    rank_releases: int
    released_slices: int
    consumer_links: int

class Reservation:
    """A slice reserved for writing in place; commit or cancel it once."""
    ptr: int
    nbytes: int
    @property
    def location(self) -> Literal["device", "host"]: ...
    def __dlpack__(self, *, stream: Optional[int] = ..., max_version: Optional[Tuple[int, int]] = ...,
                   dl_device: Optional[Tuple[int, int]] = ..., copy: Optional[bool] = ...) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    def memoryview(self) -> memoryview: ...

class Pool:
    device: int
    memory_location: Literal["device", "host"]
    consumer_count: int
    def __init__(self, *, memory_size: int, device: int = ..., consumer_count: int = ...,
                 max_slices: int = ..., handle_type: Literal["auto", "posix_fd", "fabric"] = ...,
                 allow_posix_fallback: bool = ..., round_up: bool = ...,
                 broker_path: Optional[str] = ..., timeout_ms: int = ...,
                 recycle_interval_us: int = ..., handoff: Literal["auto", "stream", "sync"] = ...,
                 device_control_table: bool = ...,
                 memory_location: Literal["device", "host"] = ..., host_numa_node: int = ...,
                 elastic: bool = ..., chunk_size: int = ..., min_resident: int = ...,
                 idle_release_ms: int = ..., consumer_lease_ms: int = ...) -> None: ...
    @property
    def pool_id(self) -> bytes: ...
    @property
    def data_bytes(self) -> int: ...
    def publish(self, array: _DLPackArray, stream: StreamLike = ...) -> Descriptor: ...
    def publish_many(self, arrays: Sequence[_DLPackArray],
                     stream: StreamLike = ...) -> List[Descriptor]: ...
    def cancel(self, desc: Union[bytes, Reservation]) -> None: ...
    def reserve(self, nbytes: int) -> Reservation: ...
    def commit(self, reservation: Reservation, dtype: Any = ...,
               shape: Optional[Sequence[int]] = ..., *, like: Any = ...,
               stream: StreamLike = ...) -> Descriptor: ...
    def reclaim(self) -> int: ...
    def drain(self, timeout_ms: int = ...) -> None: ...
    def stats(self) -> PoolStats: ...
    def release_rank(self, rank: int) -> None: ...
    def poll_deaths(self) -> List[int]: ...
    def close(self, timeout_ms: Optional[int] = ...) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> "Pool": ...
    def __exit__(self, *exc: Any) -> bool: ...

class Consumer:
    def __init__(self, *, timeout_ms: int = ..., max_pools: int = ...,
                 cache_bytes: int = ...) -> None: ...
    def cache_info(self) -> Tuple[int, int, int, int]: ...
    @overload
    def consume(self, desc: bytes, device: Optional[int] = ..., out: None = ...,
                stream: StreamLike = ..., *, ranks: Ranks) -> Buffer: ...
    @overload
    def consume(self, desc: bytes, device: Optional[int] = ..., *, out: _Out,
                stream: StreamLike = ..., ranks: Ranks) -> _Out: ...
    def ack(self, desc: bytes, device: Optional[int] = ..., stream: StreamLike = ..., *,
            ranks: Ranks) -> None: ...
    def check(self, desc: bytes) -> None: ...
    def evict(self, pool_id: Union[bytes, Descriptor], device: Optional[int] = ...) -> None: ...
    def pool_count(self) -> int: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def __enter__(self) -> "Consumer": ...
    def __exit__(self, *exc: Any) -> bool: ...
