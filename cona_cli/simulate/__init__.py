"""`cona simulate`: the real policies on a simulated clock, to tell before spending GPU hours whether
chaining pays on a cluster (see `world` for what is simulated, `law` for the training dynamics)."""
