"""The choices a verifier backend is loaded with (`load_verifier`)."""

BACKENDS = ("torch", "mlx")
TORCH_FORWARDS = ("auto", "library")
# Whether the torch backend's direct forward runs its decode steps compiled by torch.compile (`TorchVerifier`).
COMPILE_MODES = ("auto", "on", "off")
# How the verifier holds its linear layers' weights (`torch_backend.weights`); `auto` is chosen by the caller.
WEIGHTS = ("float32", "bfloat16", "int8", "int4")
