"""The wheels the GPU machine lacks, downloaded here, and the size of what travels with the checkout.

The device (docs/platform.md) has torch, lightning, transformers, peft, triton and
pytest but none of the packages below; it reaches no registry, so they travel as cp312 manylinux
wheels in ``benchmarks/gpu/wheels/`` (ignored by git), installed there with ``--no-deps`` into a
target folder. The pins are the versions that installed together here (docs/platform.md); torchao 0.18's
compiled extensions load with torch >= 2.11, the device's torch.

Left out on purpose:

- ``datasets`` (+ ``dill``, ``multiprocess``): lit-ablate imports it only inside the file and hub
  sources (``LocalFiles``, ``HubDataset``), which no lane step reads (every step uses synthetic
  data), and it would run on the device's own pyarrow/fsspec, whose versions nobody checked.
- ``trl``: only the DPO-vs-TRL tests use it, none of them ``gpu``-marked; ``zstandard``: MDS only.
- flash-attn: no wheel exists (source only, needs CUDA to build); its tests skip with that reason.

bitsandbytes' wheel is 43 MB because it holds one library per CUDA version (11.8 to 13.2) and
ROCm; the device's torch is built for CUDA 13, so ``slim_bitsandbytes`` writes a copy with the CPU
and CUDA 13.x libraries only (~3 MB), and the lane tests bitsandbytes in the same run.

    python benchmarks/gpu/wheels.py download [--no-bitsandbytes]
    python benchmarks/gpu/wheels.py size
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = Path(__file__).resolve().parent / "wheels"
"""The carried folder (``carry: ["benchmarks/gpu/wheels"]``); .gitignore lists it."""
MANIFEST = "manifest.json"
"""Written beside the wheels: what was downloaded, from which commit (the device copy has no .git)."""

CARRIED: dict[str, str] = {
    "jsonargparse": "4.53.0",  # LightningCLI, every `lit-ablate` command
    "docstring-parser": "0.18.0",  # jsonargparse[signatures]
    "typeshed-client": "2.15.0",  # jsonargparse[signatures]
    "liger-kernel": "0.8.5",  # loss: liger, DPO logprobs: liger
    "cut-cross-entropy": "25.1.1",  # loss: cce
    "torchao": "0.18.0",  # model.fp8, torchao's AdamW8bit
    "submitit": "1.5.4",  # imported by the SLURM launcher's tests
}
BITSANDBYTES = "0.50.2"
KEEP_CUDA_LIBRARIES = re.compile(r"libbitsandbytes_(cpu|cuda13\d)\.so$")
"""bitsandbytes libraries kept in the slim wheel: the CPU one and CUDA 13.x (torch 2.11+cu130 there)."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
LIMIT_BYTES = 64 * 2**20
"""What the device takes: tracked and untracked-not-ignored files plus the carried folders."""
HEADROOM_BYTES = 4 * 2**20
"""``size`` fails above LIMIT - HEADROOM: results committed between prepare and the run must still fit."""


def download(include_bitsandbytes: bool) -> list[Path]:
    """Fresh ``wheels/``: the pinned wheels (and slim bitsandbytes), one version of each."""
    if WHEELS.exists():
        shutil.rmtree(WHEELS)
    WHEELS.mkdir(parents=True)
    pins = [f"{name}=={version}" for name, version in CARRIED.items()]
    _pip_download(pins, WHEELS)
    if include_bitsandbytes:
        with tempfile.TemporaryDirectory() as tmp:
            _pip_download([f"bitsandbytes=={BITSANDBYTES}"], Path(tmp))
            (full,) = Path(tmp).glob("bitsandbytes-*.whl")
            slim_bitsandbytes(full, WHEELS / full.name)
    wheels = sorted(WHEELS.glob("*.whl"))
    names = [re.split(r"-\d", w.name, maxsplit=1)[0].lower().replace("_", "-") for w in wheels]
    if len(set(names)) != len(names):
        raise SystemExit(f"two versions of one package in {WHEELS}: {names} (pip --no-deps would stop the install)")
    (WHEELS / MANIFEST).write_text(json.dumps(manifest(wheels), indent=1) + "\n")
    return wheels


def _pip_download(requirements: list[str], into: Path) -> None:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(into),
            *requirements,
        ],
        check=True,
    )


def slim_bitsandbytes(source: Path, target: Path) -> None:
    """A copy of bitsandbytes' wheel without the libraries for other CUDA/ROCm versions.

    The RECORD keeps the hashes of the files kept (pip installs what the archive holds and rewrites
    RECORD; a RECORD line for a missing file would be listed as installed but absent)."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as new:
        dropped = {
            n
            for n in old.namelist()
            if n.endswith(".so") and "libbitsandbytes_" in n and not KEEP_CUDA_LIBRARIES.search(n)
        }
        if not any(KEEP_CUDA_LIBRARIES.search(n) and "cuda" in n for n in old.namelist()):
            raise SystemExit(
                f"{source.name} has no CUDA 13 library: check KEEP_CUDA_LIBRARIES against the device's CUDA"
            )
        for info in old.infolist():
            if info.filename in dropped:
                continue
            data = old.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(
                    line for line in data.decode().splitlines(keepends=True) if line.split(",", 1)[0] not in dropped
                ).encode()
            new.writestr(info, data)


def manifest(wheels: list[Path]) -> dict:
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": commit,
        "git_dirty": dirty,
        "wheels": {w.name: {"bytes": w.stat().st_size, "sha256": _sha256(w)} for w in wheels},
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""


def travelling_bytes() -> dict[str, int]:
    """Bytes of what a device call sends: tracked files, untracked files git does not ignore, the wheels."""
    listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    checkout = sum((ROOT / p).stat().st_size for p in listed if p and (ROOT / p).is_file())
    carried = sum(p.stat().st_size for p in WHEELS.rglob("*") if p.is_file()) if WHEELS.exists() else 0
    return {"checkout": checkout, "wheels": carried, "total": checkout + carried}


def version_drift() -> list[str]:
    """Pins that differ from what is installed here (the CPU tests run against the installed ones)."""
    pins = {**CARRIED, "bitsandbytes": BITSANDBYTES}
    drift = []
    for name, pinned in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "not installed"
        if installed != pinned:
            drift.append(f"{name}: pinned {pinned}, here {installed}")
    return drift


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("download", help="download the pinned wheels into benchmarks/gpu/wheels/ (replaced)")
    get.add_argument("--no-bitsandbytes", action="store_true", help="leave bitsandbytes out (its tests then skip)")
    sub.add_parser("size", help="print what travels and fail above 64 MiB minus headroom")
    args = parser.parse_args()
    if args.command == "download":
        for wheel in download(include_bitsandbytes=not args.no_bitsandbytes):
            print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
        for line in version_drift():
            print(f"note: {line}")
        return 0
    sizes = travelling_bytes()
    print(
        f"travels: checkout {sizes['checkout'] / 2**20:.1f} MiB + wheels {sizes['wheels'] / 2**20:.1f} MiB "
        f"= {sizes['total'] / 2**20:.1f} MiB of {LIMIT_BYTES / 2**20:.0f} MiB"
    )
    if sizes["total"] > LIMIT_BYTES - HEADROOM_BYTES:
        print(
            f"too large: keep under {(LIMIT_BYTES - HEADROOM_BYTES) / 2**20:.0f} MiB "
            "(prepare --no-bitsandbytes, or move large untracked files out of the checkout)"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
