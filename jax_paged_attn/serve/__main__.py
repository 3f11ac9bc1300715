"""``python -m jax_paged_attn.serve MODEL_DIR [flags]``: the same as ``jax-paged-attn serve``."""
from jax_paged_attn.serve.cli import main

main()
