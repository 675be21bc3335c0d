import enum
from typing import Any, Callable, Iterable, List, Literal, Optional, Sequence, Tuple, Union

import vmmt

# A torch.Tensor, or a numpy.ndarray where torch is absent.
Tensor = Any
PoolKind = Literal["device", "elastic", "host"]

POOL_KINDS: Tuple[str, ...]
DEFER_CUDA_IPC_FEATURE_RECONSTRUCTION_KEY: str
NUMPY_FEATURES: Optional[bool]
MM_FEATURE_CACHE_SIZE: int
MM_ITEM_MEMORY_POOL_RECYCLE_INTERVAL: float
TRANSPORT_MODULE: str
UTILS_MODULE: str

class HandleType(enum.IntEnum):
    NONE = 0
    POSIX_FD = 1
    FABRIC = 8

def get_device_allocation_handle_type(device_id: int) -> HandleType: ...
def get_mm_feature_pool_size_per_worker(total_pool_size: int, tokenizer_worker_num: int) -> int: ...
def get_vmm_feature_consumer_count(server_args: Any = ...) -> int: ...

class ParallelLayout:
    attn_tp_rank: int
    attn_tp_size: int
    attn_cp_rank: int
    def __init__(self, attn_tp_rank: int = ..., attn_tp_size: int = ...,
                 attn_cp_rank: int = ...) -> None: ...

Resolver = Union[ParallelLayout, Any, Callable[[], Any], None]

def set_rank_resolver(resolver: Resolver) -> Resolver: ...

class CudaVmmTensorTransportProxy:
    fabric_handle: Optional[bytes]
    posix_socket_path: Optional[str]
    allocation_size: int
    data_offset: int
    data_nbytes: int
    control_offset: int
    consumer_count: int
    shape: Tuple[int, ...]
    dtype: Any
    reconstruct_tensor: Optional[Tensor]
    def __init__(self, *, descriptor: Optional[bytes] = ..., fabric_handle: Optional[bytes] = ...,
                 posix_socket_path: Optional[str] = ..., allocation_size: int = ...,
                 data_offset: int = ..., data_nbytes: Optional[int] = ...,
                 control_offset: Optional[int] = ..., consumer_count: Optional[int] = ...,
                 shape: Optional[Sequence[int]] = ..., dtype: Any = ...,
                 library: str = ...) -> None: ...
    @property
    def descriptor(self) -> Optional[vmmt.Descriptor]: ...
    @property
    def total_consumer_count(self) -> int: ...
    def reconstruct_on_target_device(self, rebuild_device_idx: int,
                                     consumer_count: Optional[int] = ...,
                                     consumer_rank: Optional[int] = ..., *,
                                     acknowledge_ranks: Optional[Sequence[int]] = ...) -> Tensor: ...
    def acknowledge_consumption(self, consumer_count: Optional[int] = ...,
                                consumer_rank: Optional[int] = ..., *,
                                acknowledge_ranks: Optional[Sequence[int]] = ...) -> None: ...
    def release_without_reconstruction(self, consumer_count: Optional[int] = ...,
                                       consumer_rank: Optional[int] = ..., *,
                                       acknowledge_ranks: Optional[Sequence[int]] = ...) -> None: ...
    def borrow_on_target_device(self, rebuild_device_idx: int, *_args: Any,
                                **_kwargs: Any) -> None: ...

class CudaVmmPackedTensorTransportProxy(CudaVmmTensorTransportProxy): ...

class CudaVmmMemoryPool:
    pool_kind: PoolKind
    device_index: int
    consumer_count: int
    allocation_size: int
    use_fabric: bool
    handle_type: HandleType
    posix_socket_path: Optional[str]
    memory_pool: None
    def __init__(self, memory_size: int, recycle_interval: float, base_gpu_id: int,
                 consumer_count: int, allow_posix_fallback: bool = ..., *,
                 pool: Optional[PoolKind] = ..., timeout_ms: int = ...) -> None: ...
    @property
    def fabric_handle(self) -> Optional[bytes]: ...
    @property
    def occupied_chunks(self) -> List[Any]: ...
    @property
    def available_chunks(self) -> List[Any]: ...
    def stats(self) -> vmmt.PoolStats: ...
    def wrap_tensor(self, tensor: Tensor) -> Union[CudaVmmTensorTransportProxy, Tensor]: ...
    def wrap_tensors(self, tensors: Iterable[Tensor]
                     ) -> Optional[List[CudaVmmPackedTensorTransportProxy]]: ...
    def cancel_proxy(self, proxy: CudaVmmTensorTransportProxy) -> None: ...
    def shutdown(self, timeout_ms: Optional[int] = ...) -> None: ...

class CudaVmmFeatureTransport:
    pool: Optional[CudaVmmMemoryPool]
    def __init__(self, server_args: Any, mm_processor: Any, *,
                 pool: Optional[PoolKind] = ...) -> None: ...
    def prepare_for_dispatch(self, mm_inputs_batch: Iterable[Any]) -> List[Any]: ...
    async def prepare_for_dispatch_async(self, mm_inputs_batch: Iterable[Any]) -> List[Any]: ...
    def wrap_items(self, mm_items: List[Any]) -> None: ...
    def cancel_for_dispatch(self, mm_items: List[Any]) -> None: ...
    def shutdown(self) -> None: ...

def install() -> None: ...
def uninstall() -> None: ...
