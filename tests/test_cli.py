"""`flashattn check`: the one-command sanity check a user runs on a new machine (every kernel family against
the fp64 oracle under the tolerance rule). On CPU: fp32, through the interpreter or the torch backend."""

from flashattn import cli


def test_check_covers_every_kernel_family_and_passes(capsys):
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("ok", "FAIL"))]
    assert lines and all(line.startswith("ok") for line in lines), out
    for family in ("causal=True", "decode paged", "block-sparse", "fp8 e4m3"):
        assert any(family in line for line in lines), family
    assert out.rstrip().endswith("0 failures")
