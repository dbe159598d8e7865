"""Fixtures of the training-side tests: a local S3 endpoint (s3_server.py)."""

from .s3_server import s3

__all__ = ["s3"]
