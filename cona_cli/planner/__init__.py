"""The planner: the strategy space, the iteration-time and memory models, their online calibration,
the search over layouts, scored by Φ (`cona_core.efficiency`). Pure numbers: no torch, no processes."""
