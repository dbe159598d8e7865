"""trainguard/kafka: what every producer, processor, sink and replay module needs to talk
to Kafka — topic names and their creation (`topics`), client security (`security`),
per-run ACLs (`acl`) and consumer lag (`lag`). No broker launcher behind it: the local
broker is development tooling (`harness.devtools.local_broker`)."""
