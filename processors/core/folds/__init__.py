"""The core's fast paths: folding a columnar block of step timings (block), a quiet row
(quiet) and an archive's stored columns (stored) with exactly the state and the outputs
of :func:`~..engine.step` over the same events, one by one (issue 20). They run compiled
with the core (core/compiled.py).
"""

from ..compiled import BUILD

BUILD.use_in(__path__, __name__)
