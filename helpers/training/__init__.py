"""Training: the one loss and training step, the Trainer, learning-rate schedules, safe checkpoints."""
