"""What the core counts over a run's life: where its time went (goodput), its failure rate
against its own baseline (baseline) and which validated checkpoints it keeps (retention).
Its hot modules run compiled with the core (core/compiled.py).
"""

from ..compiled import BUILD

BUILD.use_in(__path__, __name__)
