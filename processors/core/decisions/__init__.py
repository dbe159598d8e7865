"""What the core does about what it noticed: evict (eviction), quarantine a node
(quarantine, node_tests, peer_loss's culprit), roll back to a clean checkpoint (rollback),
drain a node predicted to fail (drain), wait or shrink when capacity is short (capacity),
wake a human (paging, repeat_step), refuse a bad checkpoint at resume (resume) and set the
checkpoint interval (interval).

Each decision's settings and state live beside it in a ``*_state`` module (data only);
its hot modules run compiled with the core (core/compiled.py).
"""

from ..compiled import BUILD

BUILD.use_in(__path__, __name__)
