"""EAGLE / P-EAGLE draft heads (in progress)."""
