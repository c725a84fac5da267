"""`flashattn bench`'s own arguments (flashattn/bench/cli.py): a device this machine lacks is one line."""

from __future__ import annotations

import pytest
import torch

from flashattn import cli


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_device_cuda_without_cuda_is_one_line(capsys, device):
    assert cli.main(["bench", "--device", device, "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"--device {device}" in err and "no CUDA device" in err and "--device cpu" in err


@pytest.mark.parametrize("device", ["foo", "mps", "cuda:x"])
def test_bad_device_is_one_line(capsys, device):
    assert cli.main(["bench", "--device", device, "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and device in err
