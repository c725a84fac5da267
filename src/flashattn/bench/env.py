"""Where a run happened: device, library versions, git revision. Goes into every result file's `meta`."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch


def pick_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA GeForce RTX 4090' -> 'geforce-rtx-4090': the results folder prefix."""
    name = re.sub(r"^(nvidia|amd)\s+", "", name.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def default_out_dir(device: torch.device, today: _dt.date | None = None) -> Path:
    today = today or _dt.date.today()
    return Path("benchmarks") / "results" / f"{slug(device_name(device))}-{today.isoformat()}"


def git_sha() -> str | None:
    """HEAD of the checkout this package runs from, '+dirty' when it has local changes.

    Machines that receive a copy of the tree without .git can pass the revision in FLASHATTN_GIT_SHA.
    """
    if os.environ.get("FLASHATTN_GIT_SHA"):
        return os.environ["FLASHATTN_GIT_SHA"]
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "")


def command_line() -> str:
    """How this run was started, as one would type it again."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    # under `python -m pkg`, argv[0] is the path of pkg/__main__.py; the spec has the name that was typed
    head = f"python -m {spec.name.removesuffix('.__main__')}" if spec else Path(sys.argv[0]).name
    return " ".join([head, *(shlex.quote(a) for a in sys.argv[1:])])


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # a broken optional install must not stop the run
        return None


def collect_meta(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    now = _dt.datetime.now().astimezone()
    return {
        "gpu": device_name(device),
        "gpu_slug": slug(device_name(device)),
        "device": str(device),
        "sms": props.multi_processor_count if props else None,
        "gpu_memory_bytes": props.total_memory if props else None,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "python": platform.python_version(),
        "git_sha": git_sha(),
        "command": command_line(),
        "date": now.date().isoformat(),
        "datetime": now.isoformat(timespec="seconds"),
    }
