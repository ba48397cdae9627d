"""Checking: a model's output against the schema, and the gate before publication."""
