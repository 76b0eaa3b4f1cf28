"""isojax: isotropy-aware fine-tuning of BERT-family encoders in JAX/Flax."""

__version__ = "0.1.0"
