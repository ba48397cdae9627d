"""Sizing: the capacity arithmetic and the interruption simulator."""
