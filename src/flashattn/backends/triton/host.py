"""Host-side arithmetic shared by the launchers and the routes, in plain Python: triton.cdiv /
next_power_of_2 are JIT functions, and calling one on the host costs ~20 µs, more than a small kernel's whole
GPU time. Imports neither torch nor Triton."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << (x - 1).bit_length() if x > 1 else 1


def block_d(d: int, elem_bytes: int = 2) -> int:
    # tl.dot needs K >= 16, and K >= 32 for 8-bit operands (elem_bytes 1: FP8's q·kᵀ); non-powers of two
    # are padded and masked
    return max(32 if elem_bytes == 1 else 16, pow2(d))


def block_dv(d: int, dv: int, elem_bytes: int = 2) -> int:
    """The padded width of V's tiles beside q's and k's of head dim d. A dv with masked columns (not a power
    of two) narrower than d's tiles takes d's width: Triton 3.6's code for the forward with V's columns
    masked in a narrower tile (d 40 beside dv 8 or 24, 64-key tiles) read shared memory out of bounds on
    the H200 (compute-sanitizer memcheck), and ran clean at d's width."""
    width, d_width = block_d(dv), block_d(d, elem_bytes)
    return d_width if dv != width and width < d_width else width


def dot_precision(dtype) -> str:
    """The kernels' DOT_PREC for inputs of a torch dtype: fp32 inputs get true fp32 products (tf32 would be
    a 1e-3 error that no fp32 user expects)."""
    return "ieee" if dtype.itemsize == 4 else "tf32"
