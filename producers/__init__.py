"""The rank side, by role: `rank/` (telemetry and commands), `training/` (the torch
integration), `checkpoint/` (the checkpoint stack), `launcher/` (`trainguard launch`)
and `simulator/` (thousands of simulated ranks emitting the same events)."""
