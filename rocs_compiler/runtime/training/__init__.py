"""Training: the training program, its step timing, table gradients, refused backward, DDP."""
