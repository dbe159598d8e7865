"""`trainguard launch`: the launcher that starts and supervises a job's ranks and executes
restart and quarantine decisions (`launcher`), where ranks run (`plan`), its
write-ahead journal (`journal`), the node self-test with known answers
(`node_selftest`) and the launcher's runs of it on spares (`spare_selftest`)."""
