"""The MLX verifier backend: mlx-lm model directories driven through mlx-lm's cache protocol."""
