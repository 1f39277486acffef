"""The inference engine: sequences, paged KV cache with prefix caching, token-budget scheduler, model runner."""
