"""The planner: the strategy space, the iteration-time and memory models, their online calibration,
the search over layouts and the surrogate Φ that scores strategies. Pure numbers: no torch, no processes."""
