"""Run code written for flash_attn 2.x on flashattn, unchanged: `import flash_attn` resolves to flashattn.

    import flashattn.compat
    flashattn.compat.install()

    import flash_attn                                   # flashattn's functions under flash_attn's names
    from flash_attn.flash_attn_interface import _flash_attn_forward, _flash_attn_backward
    from flash_attn.bert_padding import pad_input, unpad_input
    from flash_attn.layers.rotary import apply_rotary_emb
    import ring_flash_attn                              # a library that imports flash_attn runs on flashattn

or, for a whole program: `python -m flashattn.compat train.py ARGS` / `python -m flashattn.compat -m pytest
ARGS` (install, then run it as `python` would).

What install() does: it puts these module names into this process's `sys.modules`, no file and no
installed distribution involved, so it is opt-in, per process, and undone by `uninstall()`:
    flash_attn                       a package holding flash_attn 2.8's public functions (flash_attn_func,
                                     the kvpacked / qkvpacked / varlen variants, flash_attn_with_kvcache:
                                     flashattn.flash_attn_interface's, which checks a paged call's capacity
                                     as flash_attn does), __version__ "2.8.4" (the API it implements)
    flash_attn.flash_attn_interface  flashattn.flash_attn_interface: the same, plus the private functions
                                     (_flash_attn_forward, _flash_attn_varlen_forward, _flash_attn_backward,
                                     _flash_attn_varlen_backward, _get_block_size_n) other libraries call
    flash_attn.bert_padding          flashattn.bert_padding (unpad_input, pad_input, index_first_axis, ...)
    flash_attn.layers.rotary         flashattn.layers.rotary (apply_rotary_emb, apply_rotary_emb_qkv_,
                                     apply_rotary_emb_kv_)
    flash_attn_2_cuda                the extension's fwd / varlen_fwd / bwd / varlen_bwd, positional
                                     (flash_attn_interface.flash_attn_gpu)
Any other flash_attn module (flash_attn.ops, flash_attn.modules, ...) is not provided: importing it raises
ModuleNotFoundError naming what is. A flash_attn already imported in the
process is replaced (modules that bound its functions before keep them: call install() first). Child
processes (multiprocessing's spawn, torch.distributed launchers) start without it: call install() in each.
Package metadata is not faked: importlib.metadata.version("flash_attn") still fails, so libraries that
detect flash_attn through it (transformers) do not switch to it; use flashattn.integrations.transformers.

Semantics are flash_attn 2.x's (docs/compat.md lists the differences: e.g. rng_state comes back on the
CPU); errors are flashattn.errors.FlashAttnError, a RuntimeError like flash_attn's C++ checks.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import runpy
import sys
import types

__all__ = ["FLASH_ATTN_VERSION", "install", "installed", "main", "uninstall"]

FLASH_ATTN_VERSION = "2.8.4"  # the flash_attn API these modules implement
_PUBLIC = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_with_kvcache")
# flash_attn module name -> the flashattn module it resolves to
MODULES = {
    "flash_attn.flash_attn_interface": "flashattn.flash_attn_interface",
    "flash_attn.bert_padding": "flashattn.bert_padding",
    "flash_attn.layers": "flashattn.layers",
    "flash_attn.layers.rotary": "flashattn.layers.rotary",
}


class _Unprovided(importlib.abc.MetaPathFinder):
    """Turns an import of any other flash_attn module into a ModuleNotFoundError that says what exists."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("flash_attn."):
            provided = ", ".join(["flash_attn", *MODULES])
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: flashattn.compat provides {provided} (flash_attn 2.x's "
                f"functions on flashattn), not the rest of the flash_attn distribution", name=fullname)
        return None


_finder = _Unprovided()


def installed() -> bool:
    """Whether `flash_attn` resolves to flashattn in this process."""
    return getattr(sys.modules.get("flash_attn"), "__flashattn_compat__", False)


def install() -> types.ModuleType:
    """Make `import flash_attn` (and its submodules above) resolve to flashattn in this process; returns
    the `flash_attn` module. Idempotent."""
    if installed():
        return sys.modules["flash_attn"]
    _forget_flash_attn()
    pkg = types.ModuleType("flash_attn", "flash_attn 2.x's API on flashattn (installed by flashattn.compat).")
    # a package with no directory: only the submodules placed in sys.modules exist
    pkg.__path__ = []
    pkg.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    pkg.__version__ = FLASH_ATTN_VERSION
    pkg.__flashattn_compat__ = True
    interface = importlib.import_module(MODULES["flash_attn.flash_attn_interface"])
    for name in _PUBLIC:
        setattr(pkg, name, getattr(interface, name))
    sys.modules["flash_attn"] = pkg
    for alias, real in MODULES.items():
        module = importlib.import_module(real)
        sys.modules[alias] = module
        parent, _, child = alias.rpartition(".")
        setattr(sys.modules[parent], child, module)
    # the extension module, for code that calls its entry points directly
    ext = types.ModuleType("flash_attn_2_cuda", "flash_attn 2.8's extension entry points on flashattn.")
    for name in ("fwd", "varlen_fwd", "bwd", "varlen_bwd"):
        setattr(ext, name, getattr(sys.modules["flash_attn.flash_attn_interface"].flash_attn_gpu, name))
    ext.__flashattn_compat__ = True
    sys.modules["flash_attn_2_cuda"] = ext
    sys.meta_path.insert(0, _finder)
    return pkg


def uninstall() -> None:
    """Undo install(): `flash_attn` is no longer importable through flashattn in this process."""
    if installed():
        _forget_flash_attn()
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def _forget_flash_attn() -> None:
    for name in [n for n in sys.modules
                 if n in ("flash_attn", "flash_attn_2_cuda") or n.startswith("flash_attn.")]:
        del sys.modules[name]


def main(argv: list[str] | None = None) -> None:
    """`python -m flashattn.compat SCRIPT ARGS` or `python -m flashattn.compat -m MODULE ARGS`: install(),
    then run the script or module as `python` would, with sys.argv set to what follows it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit("usage: python -m flashattn.compat SCRIPT [ARGS] | -m MODULE [ARGS]")
    install()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    # `python -m flashattn.compat` runs this file as __main__: delegate to the importable module, whose
    # state install() and uninstall() share with every later `import flashattn.compat`
    from flashattn.compat import main as _main

    _main()
