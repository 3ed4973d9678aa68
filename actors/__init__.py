"""Behaviour: actors, their concurrency, state and I/O."""
