"""Model definitions and loading (HF safetensors directories and GGUF files)."""
