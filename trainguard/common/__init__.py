"""Small utilities every side may import (the rank side, the processors, replay): they
import nothing else of the project."""
