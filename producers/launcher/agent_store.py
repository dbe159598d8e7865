"""The stores this launcher serves for its attempts' process groups, as torchrun's agent
serves its workers' (``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_PORT`` = the store's
port): no free port to race for, and a rank 0 that dies does not take the store from the
survivors still reading it. One store per attempt; the previous attempt's is kept while
its last ranks may still hold it. Used on one host by the full restart (attempt.py) and
the in-process restart (hot.py) alike; across hosts rank 0 serves it at the agreed port.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


class AgentStores:
    def __init__(self, host: str) -> None:
        self.host = host
        self._stores: dict[int, dist.TCPStore] = {}  # attempt -> its process group's store

    def port(self, attempt: int) -> int:
        """The port of `attempt`'s store, served from the first call on."""
        store = self._stores.get(attempt)
        if store is None:
            store = dist.TCPStore(
                self.host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=5)
            )
            self._stores = {a: s for a, s in self._stores.items() if a >= attempt - 1} | {attempt: store}
        return int(store.port)
