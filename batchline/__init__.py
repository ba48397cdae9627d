"""batchline: offline LLM jobs that answer every record exactly once."""

__version__ = "0.1.0"
