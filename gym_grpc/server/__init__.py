"""What every server process runs: the bootstrap, admin, health, reflection, counters, request checks."""
