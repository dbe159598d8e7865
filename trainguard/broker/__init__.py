"""trainguard/broker: a local Kafka 4.x broker from Maven Central jars, and the topics.

`local` runs the broker (`LocalBroker`, `start_local_broker`, ...); `topics` names and
creates the topics (`topic_names`, `ensure_topics`, ...).
"""

from trainguard.broker.local import (
    BrokerError,
    BrokerStatus,
    LocalBroker,
    MissingToolError,
    default_data_dir,
    ensure_jars,
    local_broker_status,
    start_local_broker,
    stop_local_broker,
)
from trainguard.broker.topics import (
    TOPICS,
    TopicMismatchError,
    TopicNames,
    TopicSpec,
    delete_topics,
    ensure_topics,
    topic_names,
)

__all__ = [
    "TOPICS",
    "BrokerError",
    "BrokerStatus",
    "LocalBroker",
    "MissingToolError",
    "TopicMismatchError",
    "TopicNames",
    "TopicSpec",
    "default_data_dir",
    "delete_topics",
    "ensure_jars",
    "ensure_topics",
    "local_broker_status",
    "start_local_broker",
    "stop_local_broker",
    "topic_names",
]
