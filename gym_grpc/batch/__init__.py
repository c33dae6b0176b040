"""Collecting at scale: jobs through a bounded window, `collect`, `reverify` and their summaries."""
