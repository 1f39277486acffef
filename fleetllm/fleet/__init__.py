"""A fleet on one machine: ``fleetllm serve`` starts the workers and the router as processes."""
