"""The rank's telemetry and command path: the agent a training loop calls
(`agent`), the non-blocking shipper to Kafka (`shipper`), the actuator that verifies and
executes signed commands exactly once (`actuator`) and the rank's command handlers
(`handlers`)."""
