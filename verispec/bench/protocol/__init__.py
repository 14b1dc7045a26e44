"""The measurement protocol: warm-up, seeded order, repeated passes, asserted completion."""
