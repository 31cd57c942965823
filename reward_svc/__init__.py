"""Loom reward service. Rewards: accuracy, format, length, reflection, efficiency; isolated verification."""

import os

# sympy reads its ground types once, at import: with gmpy2 it ignores math-verify's alarms on huge
# integers (shared/notes/verifier.md). Set before anything here can import sympy.
os.environ.setdefault("SYMPY_GROUND_TYPES", "python")
