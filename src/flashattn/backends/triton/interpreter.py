"""Correct FP8 casts for kernels run by Triton's interpreter (TRITON_INTERPRET=1, CPU tensors).

Triton 3.6's interpreter narrows floats to 8-bit formats by truncating the significand and adding the cut-off
bit without carrying it into the exponent: 0.4951 becomes 0.25 in e4m3, where the GPU's cvt.rn gives 0.5
(about 4% of random values are wrong, by up to half their magnitude). The FP8 kernels round P and the
appended keys to e4m3, so under the interpreter they would compute something the GPU never does. `install`
replaces the narrowing casts to e4m3 and e5m2 with torch's round-to-nearest-even conversions, e4m3
saturating at ±448 as the GPU's cvt.rn.satfinite does; every other cast keeps the interpreter's code.
"""

import numpy as np
import torch

from flashattn import _internals

_TORCH_SOURCES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_TORCH_TARGETS = {"fp8e4nv": (torch.float8_e4m3fn, 448.0), "fp8e5": (torch.float8_e5m2, None)}
_UINTS = {32: np.uint32, 16: np.uint16}


def _fixed(original):
    def convert(data, input_dtype, output_dtype, rounding_mode):
        source = _TORCH_SOURCES.get(input_dtype.name)
        target = _TORCH_TARGETS.get(output_dtype.name)
        if source is None or target is None or "RTZ" in str(rounding_mode):
            return original(data, input_dtype, output_dtype, rounding_mode)
        width = input_dtype.primitive_bitwidth
        bits = np.frombuffer(np.ascontiguousarray(data).tobytes(), dtype=_UINTS[width])
        signed = bits.view(np.int32 if width == 32 else np.int16)
        x = torch.from_numpy(signed.copy()).view(source).float()
        dtype, limit = target
        if limit is not None:
            x = x.clamp(-limit, limit)  # NaN stays NaN
        return x.to(dtype).view(torch.uint8).numpy().reshape(np.shape(data))
    convert.flashattn_fixed = True
    return convert


def install() -> bool:
    """Patch the interpreter's float conversion (idempotent; through flashattn._internals, on the tested
    Triton only). Whether it is patched."""
    return _internals.patch_interpreter_casts(_fixed)
