"""producers/simulator."""
