"""LoRA adapters served beside their base model: PEFT's format read and checked, adapters resident in the step's
tables (``tables.py``), kept in memory behind them, and applied per row inside the batch (docs/lora.md)."""
