"""The two implementations of every op, and which one serves a call.

`triton` (backends/triton/): the Triton and Gluon kernels, for CUDA tensors, and for CPU tensors when the
process runs under TRITON_INTERPRET=1 (how CI tests the kernels). `torch` (backends/torch/): the same
algorithms in plain PyTorch (exact, O(N·d) memory), for every other CPU tensor. `flashattn.config`'s
backend setting (FLASHATTN_BACKEND) forces one.

Each backend's `entry` module has the same functions with the same signatures (pure functions: tensors in,
tensors out, no autograd): attention_forward, attention_backward, attention_probs, block_sparse_forward,
block_sparse_backward, kvcache_forward, merge_partials. A backend is imported on its first call, so
`import flashattn` loads no kernel.
"""

import importlib

import torch

from flashattn import config
from flashattn.errors import FlashAttnError

BACKENDS = config.BACKENDS
_modules: dict = {}
# a prepared decode launch's workspace argument (kvcache_forward's DecodeLaunch): take the current stream's,
# kept between calls, rather than allocate one (a backend without workspaces ignores it)
STREAM_WORKSPACE = "stream"


def backend_name(t: torch.Tensor) -> str:
    """The backend that serves tensors like t."""
    forced = config.backend
    if forced is not None:
        if forced == "triton" and not t.is_cuda and not config.INTERPRET:
            raise FlashAttnError(
                f"the backend is forced to triton but the tensors are on {t.device}: the Triton kernels need "
                f"a CUDA device, or TRITON_INTERPRET=1 set before the process starts to interpret them on "
                f"the CPU"
            )
        return forced
    return "triton" if t.is_cuda or config.INTERPRET else "torch"


def entry(t: torch.Tensor):
    """The entry module of the backend that serves tensors like t."""
    name = backend_name(t)
    module = _modules.get(name)
    if module is None:
        module = _modules[name] = importlib.import_module(f"flashattn.backends.{name}.entry")
    return module
