"""The error every Kafka helper raises when the broker cannot be set up or reached.

Its own module so that topics, ACLs and the local broker launcher (development tooling)
share it without importing one another."""


class BrokerError(RuntimeError):
    """The broker cannot be set up, started or reached, or its topics do not match."""
