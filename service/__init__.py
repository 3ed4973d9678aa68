"""Assembly: configuration, the command line, pipeline wiring and the demo."""
