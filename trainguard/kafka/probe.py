"""Is the broker there? One bounded, quiet check before a long-running command starts.

librdkafka retries a refused connection every few tens of milliseconds and logs each
failure to stderr, so a processor pointed at the wrong address would print hundreds of
lines and never exit. The probe asks for metadata once, with its log routed to a logger
that keeps only the last complaint, and turns a failure into one BrokerError that names
the address and the reason."""

from __future__ import annotations

import logging

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from .errors import BrokerError
from .security import KafkaCredentials, client_config

#: How long a command waits for the broker before it gives up (seconds).
DEFAULT_PROBE_S = 15.0


class _LastComplaint(logging.Handler):
    """Keeps the last line librdkafka logged (e.g. 'Connect to ipv4#127.0.0.1:1 failed:
    Connection refused'), the most specific reason there is."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.last = record.getMessage()


def probe_broker(
    bootstrap: str, timeout_s: float = DEFAULT_PROBE_S, credentials: KafkaCredentials | None = None
) -> int:
    """The number of brokers the cluster at `bootstrap` names; BrokerError, after at most
    `timeout_s`, when it cannot be reached (or refuses the credentials)."""
    complaint = _LastComplaint()
    logger = logging.getLogger(f"{__name__}.librdkafka.{id(complaint)}")
    logger.propagate = False
    logger.addHandler(complaint)
    admin = AdminClient(client_config({"bootstrap.servers": bootstrap, "logger": logger}, credentials))
    try:
        brokers = admin.list_topics(timeout=timeout_s).brokers
    except KafkaException as exc:
        admin.poll(0)  # serves the queued log lines to the handler
        reason = _reason(complaint.last) or exc.args[0].str()
        raise BrokerError(
            f"cannot reach the Kafka broker at {bootstrap} within {timeout_s:g} s: {reason}"
        ) from exc
    finally:
        del admin  # stops its retries; the logger goes with it
        logger.removeHandler(complaint)
    return len(brokers)


def _reason(line: str) -> str:
    """librdkafka's line without its thread and address prefix: '[thrd:..]: host/bootstrap:
    Connect to ... failed: Connection refused (after 0ms in state CONNECT)' -> from 'Connect'."""
    text = line.rsplit("]: ", 1)[-1]
    _, _, tail = text.partition("/bootstrap: ")
    return (tail or text).strip()
