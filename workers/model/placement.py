"""`--device` and `--dtype` as every command that loads the engine takes them (`serve`, `generate`,
`bench engine`, `bench structured`, `bench profile`): one set of choices and words, so a setting
that works for one command works for the others. Free of torch: `specgate serve --ray`'s driver
parses these arguments and never loads a model (workers/model/device.py resolves the names)."""
from __future__ import annotations

import argparse

DTYPE_NAMES = ("float32", "bfloat16", "float16")      # workers/model/device.py DTYPES' names
DEVICE_HELP = "where the engine runs: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N"


def add_placement_arguments(p: argparse.ArgumentParser, *, device: str | None = "auto",
                            dtype: str | None = "float32", dtype_help: str = "") -> None:
    """--dtype and --device with these defaults (None: the caller's settings decide, as serve's,
    whose own defaults are float32 and auto: the help says so where argparse has no default)."""
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=dtype,
                   help="the engine's weights and activations" + ("" if dtype else " (default float32)")
                   + (f". {dtype_help}" if dtype_help else ""))
    p.add_argument("--device", default=device, help=DEVICE_HELP + ("" if device else " (default auto)"))
