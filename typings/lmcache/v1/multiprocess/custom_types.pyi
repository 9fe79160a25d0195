from typing import Any

class IPCCacheServerKey:
    model_name: str
    world_size: int
    worker_id: int | None
    token_ids: tuple[int, ...]
    start: int
    end: int
    request_id: str
    num_kv_readers: int
    def __init__(
        self,
        model_name: str,
        world_size: int,
        worker_id: int | None,
        token_ids: tuple[int, ...],
        start: int,
        end: int,
        request_id: str,
        cache_salt: str = "",
        request_configs: dict[str, Any] | None = None,
        num_kv_readers: int = 0,
    ) -> None: ...

class RegisterEngineDrivenContextPayload:
    def __init__(
        self,
        instance_id: int,
        model_name: str,
        world_size: int,
        block_size: int,
        num_layers: int,
        hidden_dim_size: int,
        dtype_str: str,
        use_mla: bool,
        num_physical_slots: int | None = None,
    ) -> None: ...

class RegisterEngineDrivenContextResponse:
    shm_name: str
    pool_size: int

class PrepareStoreResponse:
    context: dict[str, Any]

class PrepareRetrieveResponse:
    success: bool
    data: bytes
    context: dict[str, Any]
