"""One driver per system: how to enqueue, start workers and read completion records."""
