"""TorchTitan integration: the job-config section and the model converter."""
