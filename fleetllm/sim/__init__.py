"""The simulated worker (``fleetllm worker --simulate``): a real worker's HTTP API, scheduler, block
pool, prefix cache and KV events, with the model replaced by a timing model calibrated from the real
engine (``fleetllm calibrate``). It lets routing and fleet experiments run 16–256 replicas on one
machine; it never stands in for the engine in tests of the engine or the API.
"""
