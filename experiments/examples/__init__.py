"""Examples that call the library: `python -m experiments.examples.compare` (several methods
side by side) and `python -m experiments.examples.nnx_finetune` (an NNX fine-tuning run)."""
