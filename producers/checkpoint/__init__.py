"""The checkpoint stack: validated, atomic, asynchronous checkpoints (`manager`), what
one holds (`train_state`), the host-memory staging copy (`host_stager`), the peer
replica in another failure domain (`peer_replica`), validation before a resume
(`validate`) and the interval in force turned into steps (`cadence`)."""

from ...common.moved import forwarder

# Before the split into sub-packages `trainguard.producers.checkpoint` was the manager's
# module; a script's imports from it keep working for a while, warning with the public path.
__getattr__ = forwarder(
    __name__,
    {
        name: (f"trainguard.producers.checkpoint.manager:{name}", "trainguard.torch")
        for name in ("CheckpointManager", "CheckpointError")
    },
)
