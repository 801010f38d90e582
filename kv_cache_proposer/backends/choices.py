"""The choices a verifier backend is loaded with (`load_verifier`)."""

BACKENDS = ("torch", "mlx")
# How the torch backend runs a forward (`TorchVerifier`): auto and fast run supported models directly over their
# weights (auto with a CPU's shape-invariant kernels, fast without them), library through transformers' modules.
TORCH_FORWARDS = ("auto", "fast", "library")
# Whether the torch backend's direct forward runs its decode steps compiled by torch.compile (`TorchVerifier`).
COMPILE_MODES = ("auto", "on", "off")
# How the verifier holds its linear layers' weights (`torch_backend.weights`); `auto` is chosen by the caller.
WEIGHTS = ("float32", "bfloat16", "int8", "int4")
# How the verifier holds a session's dense K/V: in the model's dtype, or rounded to bfloat16 (torch's direct
# forward); auto is bfloat16 where the torch backend's products already take bfloat16 inputs (weights held at 8 or
# 4 bits) and its direct forward runs, else the model's dtype.
KV_DTYPES = ("auto", "model", "bfloat16")
