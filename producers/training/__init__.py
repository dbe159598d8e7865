"""The torch integration: the supervisor a training loop wraps (`supervisor`), the
gradient checks for silent data corruption (`grad_checks`), the ring and three-rank
cross checks on real ranks (`ring_check`, `cross_check`), GPU health through NVML
(`gpu_health`). Its chaos knobs (a wrong device, injected health) are in producers/chaos."""

from ...common.moved import deprecate_names, forwarder

# Before the split into sub-packages `trainguard.producers.training` was the supervisor's
# module; a script's imports from it keep working for a while, warning with the public path.
__getattr__ = forwarder(
    __name__,
    {
        name: (f"trainguard.producers.training.supervisor:{name}", "trainguard.torch")
        for name in ("Supervisor", "SupervisorConfig", "NonFiniteLoss", "init_process_group")
    },
)
deprecate_names(__name__, "trainguard.torch", ("inprocess",))
