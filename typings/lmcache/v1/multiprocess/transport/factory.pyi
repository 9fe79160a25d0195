from typing import Any

from lmcache.v1.multiprocess.transport.base import RequestClient

class RequestClientFactory:
    @staticmethod
    def create(server_url: str, *, context: Any | None = None) -> RequestClient: ...
