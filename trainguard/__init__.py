"""trainguard: keeps long synchronous training runs alive and trustworthy."""

__version__ = "0.1.0"
