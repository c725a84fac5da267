"""Dropout's (seed, offset), drawn inside the forward ops from torch's generator for the device: the CUDA
generator's Philox seed and offset, advanced by the counters used, as torch's own dropout does. The ops return
them as `rng_state` and save them for the backward, which regenerates the same mask. torch.manual_seed makes
runs repeatable, and torch.utils.checkpoint's RNG-state replay reproduces the mask."""

import torch
from torch import Tensor

# the state of a call without dropout: one shared tensor (never written; allocating one per call costs ~1 us)
NO_RNG = torch.zeros(2, dtype=torch.int64)


def draw_rng_state(device: torch.device, counters: int) -> Tensor:
    """(seed, offset) int64 on the CPU for a call that draws `counters` random numbers."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gen = torch.cuda.default_generators[index]
        seed, offset = gen.initial_seed(), gen.get_offset()
        gen.set_offset(offset + (counters + 3) // 4 * 4)  # CUDA Philox offsets advance in steps of 4
    else:
        seed, offset = (int(x) for x in torch.randint(0, 2**62, (2,)))
    return torch.tensor([seed, offset], dtype=torch.int64)


def unpack(rng_state: Tensor, dropout_p: float) -> tuple[int, int]:
    """(seed, offset) as the launchers take them; (0, 0) without dropout."""
    if dropout_p > 0:
        seed, offset = rng_state.tolist()
        return seed, offset
    return 0, 0
