"""The labelled scenarios scored (issue 48: part of the development harness, not of the
product): detections and decisions against the scenario's truth (`evaluate`), what a user
suffers (`harms`), the live pipeline's log checked against its acks and a replay (`oracle`),
elastic training's wait against shrink (`capacity`) and failure prediction on against off
(`prediction`). They drive the product's pure core and replay; the product imports none of
them (tests/test_architecture.py)."""
