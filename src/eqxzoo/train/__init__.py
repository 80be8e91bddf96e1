"""Train state, step, checkpoints and the training loop."""
