"""The real Gemma-3-270M's test prompts, shared by tests/models/test_gemma3.py and benchmarks/gemma3_vs_hf.py."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "SELECT name, email FROM users WHERE",
    "In 1969, the first humans to walk on the Moon",
    "Water boils at 100 degrees Celsius because",
]
# Longer than the 512-token sliding window: its later tokens must not see its first ones in local layers.
LONG = "Here is a list of numbered facts.\n" + "".join(f"Fact {i}: the number {i} squared is {i * i}.\n" for i in range(1, 37))
PROMPTS_WITH_LONG = [*PROMPTS, LONG]
MAX_TOKENS, LONG_TOKENS = 24, 6
CAPS = [MAX_TOKENS] * len(PROMPTS) + [LONG_TOKENS]
TOKENIZER_TEXTS = [*PROMPTS_WITH_LONG, "  two  spaces,\ttab\n\n\nnewlines   ", "naïve café — 東京 🚀 <0x41>",
                   "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "x" * 40 + " ünïcödé"]
