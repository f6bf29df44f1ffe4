"""What the controller (`cona_cli`) and the workers (`launch`) share, without torch: the config schema,
strategies, the run folder and exit codes, the run's clock, model shapes, the noise-scale estimator, and
Φ with the LR gain. It imports neither side (tests/test_architecture.py)."""
