"""Drills: the service under faults (outputs that stop answering, servers killed and back,
hostile input), each bounded in time and checked against what a database or file holds."""
