"""A host agent reduced to its rendezvous stage, for test_rendezvous.py: joins rounds of
torch's c10d rendezvous through HostRendezvous and prints each round's plan as one JSON
line; it goes to the next round when the file `<dir>/again-<round>` appears."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from trainguard.producers.launcher.config import free_port
from trainguard.producers.launcher.rendezvous import HostRendezvous, Proposal, RendezvousSpec


def main() -> None:
    node, endpoint, nnodes, attempt, directory = sys.argv[1:6]
    low, high = (int(n) for n in nnodes.split(":"))
    spec = RendezvousSpec(endpoint, "rdzv-test", low, high, local_addr="127.0.0.1")
    rdzv = HostRendezvous(spec, nproc_per_node=2)
    for round_ in range(5):
        t0 = time.time()
        proposal = Proposal(node, int(attempt) + round_, resume=-1)
        plan = rdzv.next_world(lambda proposal=proposal: proposal, free_port)
        line: dict[str, object] = {"node": node, "round": round_, "group_rank": rdzv.group_rank}
        line.update(ts=time.time(), wait_s=time.time() - t0, plan=json.loads(plan.to_json()))
        print(json.dumps(line), flush=True)
        again = Path(directory) / f"again-{round_}"
        while not again.exists():
            time.sleep(0.05)


if __name__ == "__main__":
    main()
