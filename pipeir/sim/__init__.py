"""Cost model and discrete-event simulator: bubble, memory and timelines."""
