"""The DFlash block-diffusion proposer: drafter network, checkpoint format and per-session drafting."""
