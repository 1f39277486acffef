"""Any other OpenAI-compatible server: health checked and load counted by the router alone."""

from fleetllm.router.backends.base import Backend

BACKEND = Backend(kind="openai")
