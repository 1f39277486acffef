"""Token counting for prompt construction, agreeing with the server where it can.

Prompts are built from fixed word lists. How many tokens a word becomes depends on the server's
tokenizer, so when the server offers ``/tokenize`` (vLLM and fleetllm workers do) we measure the
tokens-per-word ratio once and size prompts with it; otherwise we assume one token per word, which
holds for the short common words in the lists under BPE tokenizers.
"""

from __future__ import annotations

import httpx

# Short, common words: nearly all are a single BPE token with a leading space.
PROSE_WORDS: tuple[str, ...] = tuple(
    """the of and to in is was for on are with as at be by this from or have an they which one you
    had not but what all were when we there can been has more if will their so out up about into
    than them could time only new some would other these two may first then do any like my now over
    such our man me even most made after also did many before must through back years where much
    your way well down should because each just those people how too little state good very make
    world still own see men work long get here between both life being under never day same another
    know while last might us great old year off come since against go came right used take three
    small house water number part place city home light story river music paper table window garden
    market letter voice color friend school money power field order sound south north""".split()
)

# Identifier-like words for agentic contexts ("a codebase"), so the context does not read as prose.
CODE_WORDS: tuple[str, ...] = tuple(
    """def return self import from class if else for in while try except raise with as None True
    False async await yield lambda pass break continue print len range list dict set int str float
    bool open read write path name value result items key index count data config request response
    token block cache model batch step state error event handler client server worker router queue
    buffer stream chunk offset size limit start end first last next prev node tree hash table map""".split()
)


class TokenCounter:
    """Counts tokens with the server's ``/tokenize`` when available, else one token per word."""

    def __init__(self, base_url: str | None = None, model: str | None = None, timeout_s: float = 10.0):
        self.base_url = base_url.rstrip("/") if base_url else None
        self.model = model
        self.timeout_s = timeout_s
        self.server_side: bool | None = None  # None until the first call tells us

    def count(self, text: str) -> int:
        """Tokens in ``text``; falls back to whitespace words if the server has no ``/tokenize``."""
        if self.base_url and self.server_side is not False:
            n = self._server_count(text)
            if n is not None:
                self.server_side = True
                return n
            self.server_side = False
        return len(text.split())

    def _server_count(self, text: str) -> int | None:
        # vLLM and fleetllm read "prompt"; llama.cpp's llama-server reads only "content" and answers
        # {"tokens": []} to anything else, so an empty list for non-empty text means "try the other form".
        for body in ({"model": self.model, "prompt": text}, {"content": text}):
            n = self._post_count(body)
            if n is None:
                continue
            if n > 0 or not text.strip():
                return n
        return None

    def _post_count(self, body: dict[str, object]) -> int | None:
        try:
            r = httpx.post(f"{self.base_url}/tokenize", json=body, timeout=self.timeout_s)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            answer = r.json()
        except ValueError:
            return None
        if "count" in answer:
            return int(answer["count"])
        if isinstance(answer.get("tokens"), list):
            return len(answer["tokens"])
        return None

    def tokens_per_word(self, words: tuple[str, ...] = PROSE_WORDS, sample: int = 400) -> float:
        """Measured tokens per word of ``words`` (a cyclic sample of ``sample`` words)."""
        text = " ".join(words[i % len(words)] for i in range(sample))
        return max(self.count(text), 1) / sample
