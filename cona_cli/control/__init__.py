"""The controller: launches torchrun under a strategy, follows telemetry, asks its policy (static,
chain, cona) when to switch, checkpoints and relaunches, classifies failures, and keeps its state
for `--resume`."""
