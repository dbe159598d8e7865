"""`trainguard launch`: the launcher that starts and supervises a job's ranks and executes
restart and quarantine decisions. `launcher` composes its stages (`run_state`,
`commands`, `attempt`, `restarts`, `resume`, `spares`, `recovery`, `events`); see
docs/architecture.md."""
