"""Operations: running local fleets, reports, drills, metrics, logs and credentials."""
