"""Built-in passes over the schedule IR, and the pass infrastructure."""
