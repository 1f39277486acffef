"""The OpenAI-compatible HTTP worker around one engine.

- :mod:`.app`             the worker's HTTP app (:class:`~fleetllm.server.app.Worker`): parse, call the engine, format.
- :mod:`.protocol`        OpenAI request parsing and error bodies (shared with the router).
- :mod:`.openai_format`   OpenAI response objects and SSE chunks, as pure functions of engine outputs.
- :mod:`.uvicorn_runner`  runs an app under uvicorn, telling it when shutdown starts.
"""
