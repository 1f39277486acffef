"""Tool calling: request fields (``tools``, ``tool_choice``, tool messages), per-family parsers of the
model's call syntax, the tool-aware chat template shipped for models whose own has none, and the
streaming rewrite of generated text into ``delta.tool_calls``."""
