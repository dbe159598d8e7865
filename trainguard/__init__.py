"""trainguard: keeps long synchronous training runs alive and trustworthy.

A training script imports from `trainguard.torch` (or `trainguard.lightning`,
`trainguard.transformers`): docs/api.md lists what is public. Importing `trainguard` imports
nothing else of the package."""

__version__ = "0.1.0"
