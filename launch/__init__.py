"""Worker side: model, parallelization, data, checkpoints and the training loop run under torchrun."""
