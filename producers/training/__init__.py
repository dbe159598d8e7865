"""The torch integration: the supervisor a training loop wraps (`supervisor`), the
gradient checks for silent data corruption (`grad_checks`), the ring and three-rank
cross checks on real ranks (`ring_check`, `cross_check`), GPU health through NVML
(`gpu_health`) and the wrong-device chaos knob (`device_fault`)."""
