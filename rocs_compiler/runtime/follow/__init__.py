"""Following the original model: guards, weights, module state, dtype moves, mislabelled inputs."""
