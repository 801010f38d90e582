"""The choices a verifier backend is loaded with (`load_verifier`)."""

BACKENDS = ("torch", "mlx")
# How the torch backend runs a forward (`TorchVerifier`): auto and fast run supported models directly over their
# weights (auto with a CPU's shape-invariant kernels, fast without them), library through transformers' modules.
TORCH_FORWARDS = ("auto", "fast", "library")
# Whether the torch backend's direct forward runs its decode steps compiled by torch.compile (`TorchVerifier`).
COMPILE_MODES = ("auto", "on", "off")
# How the verifier holds its linear layers' weights (`torch_backend.weights`); `auto` is chosen by the caller.
WEIGHTS = ("float32", "bfloat16", "int8", "int4")
