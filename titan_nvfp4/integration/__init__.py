"""TorchTitan integration: the job-config section, the model converter and extra Llama3 flavors."""
