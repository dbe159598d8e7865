"""The stores this launcher serves for its attempts' process groups, as torchrun's agent
serves its workers' (``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_PORT`` = the store's
port): no free port to race for, and a rank 0 that dies does not take the store from the
survivors still reading it. One store per attempt; the previous attempt's is kept while
its last ranks may still hold it. Used on one host by the full restart (attempt.py) and
the in-process restart (hot.py) alike. Across hosts under in-process restart every agent
proposes a store it already serves (:meth:`AgentStores.reserve`: no free port to race for),
and the agent of the plan's first host keeps it for the attempt (:meth:`AgentStores.keep`);
a full restart across hosts has rank 0 serve it at the agreed port.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


class AgentStores:
    def __init__(self, host: str) -> None:
        self.host = host
        self._stores: dict[int, dist.TCPStore] = {}  # attempt -> its process group's store
        self._reserved: dict[int, dist.TCPStore] = {}  # port -> a store proposed, not taken yet

    def port(self, attempt: int) -> int:
        """The port of `attempt`'s store, served from the first call on."""
        store = self._stores.get(attempt)
        if store is None:
            self._keep(attempt, self._serve())
        return int(self._stores[attempt].port)

    def reserve(self, addr: str = "") -> int:
        """Across hosts: a store served from now on, on a free port, for this host's
        proposal (`addr`, where the others reach it, is the proposal's)."""
        store = self._serve()
        self._reserved[int(store.port)] = store
        return int(store.port)

    def keep(self, attempt: int, port: int) -> bool:
        """Across hosts: the plan took this host's store at `port` for `attempt` (True), or
        another host's; the stores proposed and not taken are closed."""
        store = self._reserved.pop(port, None)
        self._reserved.clear()
        if store is not None:
            self._keep(attempt, store)
        return store is not None

    def _serve(self) -> dist.TCPStore:
        timeout = timedelta(minutes=5)
        return dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False, timeout=timeout)

    def _keep(self, attempt: int, store: dist.TCPStore) -> None:
        self._stores = {a: s for a, s in self._stores.items() if a >= attempt - 1} | {attempt: store}
