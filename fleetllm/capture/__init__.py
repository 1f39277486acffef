"""Inference data capture at three tiers: what passed through the fleet, kept for audit, debugging and replay.

- ``endpoint`` (the router): request body and final response, SageMaker Data Capture JSONL (:mod:`.records`);
- ``access`` (the load balancer's log): one line per request, no bodies;
- ``worker`` (the pod): prompt and output as the engine saw them, token counts and phase times.

A request is sampled once, from its router-minted id (:mod:`.sampling`), so a sampled request appears at
every tier and joins by ``inferenceId``. Records are redacted (:mod:`.redaction`), appended to a local
write-ahead spool (:mod:`.spool`) in the request's path, and shipped by a background uploader
(:mod:`.uploader`) to a sink (:mod:`.sinks`: a local directory or S3, optionally envelope-encrypted,
:mod:`.envelope`). Capture never waits: a record the spool cannot take is dropped and counted.
"""
