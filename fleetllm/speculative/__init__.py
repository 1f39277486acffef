"""Speculative decoding: drafters propose K tokens per request, the target verifies them in one pass.

``config`` parses ``--speculative method=...,k=...``; ``drafter`` holds the :class:`Drafter` protocol and
the registry (``ngram``, ``suffix``, ``eagle``, ``peagle``); ``verify`` is the lossless acceptance rule;
``decoder`` is what the engine talks to (drafting, K choice, verification, counters).
"""
