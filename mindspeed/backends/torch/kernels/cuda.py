"""CUDA fast paths: none are claimed yet (catalog.FAST_PATHS["cuda"] is empty), so every kernel
runs its reference on cuda. torch's own CUDA flash attention (which returns logsumexp) is the
obvious candidate for `attention`; it belongs here once it is tested and benchmarked on a GPU.
This module exists so the dispatch table has a home for them."""
from mindspeed.backends.torch.kernels.reference import *  # noqa: F401,F403
