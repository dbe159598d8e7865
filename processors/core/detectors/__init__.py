"""What the core notices, each a pure function of a run's state and one event: hangs and
their culprit (watchdog, stack_window, stacks), whose fault a host's loss is (peer_loss),
slow ranks, nodes and racks (straggler, slowdown, group_slowdown) and their diagnosis
(diagnosis), silent data corruption (sdc*) and a node's risk of failing (hazard*).

Each detector's settings and state live beside it in a ``*_state`` module (data only,
imported by the core's policy.py and state.py); what follows a detection is decided in
decisions/. Its hot modules run compiled with the core (core/compiled.py).
"""

from ..compiled import BUILD

BUILD.use_in(__path__, __name__)
