"""The Pallas kernels. Importing this package, which every kernel module's import does
first, installs `triton_offsets`' 64-bit element offsets for refs of ``2**31`` elements
and more."""
from jax_paged_attn.kernels import triton_offsets

__all__ = ["triton_offsets"]
