"""The worker: a supervisor that owns the lease, and an engine child that owns the model."""
