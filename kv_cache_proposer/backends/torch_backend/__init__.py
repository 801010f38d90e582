"""The PyTorch verifier backend: Hugging Face checkpoints driven through transformers' cache API."""
