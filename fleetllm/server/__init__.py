"""The OpenAI-compatible HTTP worker around one engine."""
