"""The checkpoint stack: validated, atomic, asynchronous checkpoints (`manager`), what
one holds (`train_state`), the host-memory staging copy (`host_stager`), the peer
replica in another failure domain (`peer_replica`), validation before a resume
(`validate`) and the interval in force turned into steps (`cadence`)."""
