"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice or a grammar.

:mod:`.spec` names what a request asks for (torch-free, no grammar engine); :mod:`.compiler` turns it
into llguidance grammars, validated and cached per tokenizer; :mod:`.matcher` is one request's grammar
state, advanced token by token by the engine and asked for next-token masks by the executor.
"""
