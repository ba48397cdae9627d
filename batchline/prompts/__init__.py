"""Prompts: the shared prefix, the record's block, and retrieved examples."""
