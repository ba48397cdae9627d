"""Publication: the pointer readers follow, its targets, and exports."""
