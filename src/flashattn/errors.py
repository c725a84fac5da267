"""The one exception class flashattn raises for bad arguments.

`FlashAttnError` is a ValueError (Python's convention for a bad value), a TypeError (for a bad type: code
that catches either keeps working) and a RuntimeError (what code and tests written against flash_attn catch:
its C++ checks surface as RuntimeError). Its message names the argument, the value received and what is
expected.
"""


class FlashAttnError(TypeError, ValueError, RuntimeError):
    """A bad argument: which one, what it was, what was expected."""
