"""Loading models: GGUF and HF folder agree, tiny-random is reproducible, tokenizers round-trip,
and every way a `--model` value can be wrong is a one-line `ModelError`."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specwire.common.errors import UserError
from specwire.common.model.config import ModelError
from specwire.common.model.loader import (
    LoadedModel,
    export_hf_folder,
    load_model,
    smollm2_gguf_path,
)
from specwire.common.model.tiny_random import tiny_random_checkpoint
from specwire.common.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing tab\t\nand a newline",
    "Naïve café, Straße, 東京, Ελληνικά, emoji 🤖🎉 and a flag 🇫🇷",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Où est le café? ☕"},
]


def assert_same_model(a: LoadedModel, b: LoadedModel) -> None:
    assert a.config == b.config
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def assert_same_tokenizer(a: Tokenizer, b: Tokenizer) -> None:
    assert a.fingerprint == b.fingerprint
    assert (a.vocab_size, a.bos_token_id, a.eos_token_id, a.add_bos) == (
        b.vocab_size,
        b.bos_token_id,
        b.eos_token_id,
        b.add_bos,
    )
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
    assert a.apply_chat_template(CHAT) == b.apply_chat_template(CHAT)


# --- GGUF vs the HF folder exported from it ------------------------------------------------------


@pytest.mark.slow
def test_gguf_reader_over_a_plain_view_reads_what_gguf_reads() -> None:
    """`read_gguf`'s reader slices a plain ndarray view of the file mapping (fast) instead of the
    np.memmap itself: every field and tensor must come out the same."""
    import gguf
    import numpy as np

    from specwire.common.model.gguf_checkpoint import PlainViewReader

    path = smollm2_gguf_path()
    ours, theirs = PlainViewReader(path), gguf.GGUFReader(path)
    assert type(ours.data) is np.ndarray and len(ours.data) == path.stat().st_size
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data)
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True))
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.data_offset) == (
            t.name,
            t.tensor_type,
            t.data_offset,
        )
        assert mine.data.shape == t.data.shape and np.array_equal(mine.data, t.data), t.name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_kv_cache_bigger_than_the_gpu_is_refused_and_one_that_fits_is_zero() -> None:
    from specwire.common.model.loader import build_model

    gpu = build_model("tiny-random", tiny_random_checkpoint(), device="cuda").model
    with pytest.raises(UserError, match="free memory on cuda"):
        gpu.allocate_kv_cache(1 << 40)
    kv = gpu.allocate_kv_cache(9)
    assert kv.is_cuda and not kv.any()


@pytest.mark.slow
def test_gguf_dequantize_is_the_gguf_packages_bit_for_bit() -> None:
    """`dequantize` does Q4_1 and Q8_0 with torch: every tensor of SmolLM2's file (both types
    and F32) must come out with the bits of `gguf.dequantize`."""
    import gguf
    import numpy as np

    from specwire.common.model.gguf_checkpoint import PlainViewReader, dequantize

    reader = PlainViewReader(smollm2_gguf_path())
    types = {t.tensor_type.name for t in reader.tensors}
    assert {"Q4_1", "Q8_0", "F32"} <= types, types
    for t in reader.tensors:
        ours = dequantize(t.data, t.tensor_type)
        ref = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), np.float32))
        assert ours.shape == ref.shape and ours.dtype == torch.float32, t.name
        assert torch.equal(ours.view(torch.int32), ref.view(torch.int32)), t.name


def test_kv_cache_on_the_cpu_is_zero_and_writable(tiny) -> None:
    """The CPU pool comes from lazily zeroed pages (not a memset): zero, contiguous, of the
    asked dtype and shape, and each pool its own memory."""
    model = tiny.model
    for dtype in (torch.float32, torch.bfloat16):
        a, b = model.allocate_kv_cache(9, dtype=dtype), model.allocate_kv_cache(9, dtype=dtype)
        cfg = tiny.config
        assert a.shape == (cfg.num_layers, 2, 9, model.block_size, cfg.num_kv_heads, cfg.head_dim)
        assert a.dtype == dtype and a.is_contiguous() and not a.any()
        assert a.data_ptr() % 64 == 0  # as torch's own CPU allocator aligns
        a[1, 0, 3] = 1.5
        assert float(a.sum()) == 1.5 * a[1, 0, 3].numel() and not b.any()
    with pytest.raises(UserError, match="lower --num-kv-blocks"):
        model.allocate_kv_cache(1 << 40)  # refused before a page is promised


@pytest.mark.slow
def test_gguf_and_exported_folder_are_the_same_model(smollm2, smollm2_folder: Path) -> None:
    from_folder = load_model(str(smollm2_folder), progress=False)
    assert_same_model(smollm2, from_folder)
    assert_same_tokenizer(smollm2.tokenizer, from_folder.tokenizer)


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2) -> None:
    tok = smollm2.tokenizer
    assert tok.vocab_size == smollm2.config.vocab_size == 49152
    assert not tok.add_bos and tok.encode("Hello")[0] != tok.bos_token_id
    assert tok.decode([tok.eos_token_id]) == "<|im_end|>"
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.apply_chat_template(CHAT)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.apply_chat_template(CHAT, add_generation_prompt=False)).endswith(
        "<|im_end|>\n"
    )
    assert ids.count(tok.encode("<|im_start|>")[0]) == 3  # one special id per turn


# --- tiny-random ---------------------------------------------------------------------------------


def test_tiny_random_is_reproducible(tiny) -> None:
    a, b = tiny_random_checkpoint(), tiny_random_checkpoint()
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)
    # Pinned values: a drafter and a target on different machines must build the same model.
    head = a.tensors["model.embed_tokens.weight"][0, :3]
    assert torch.allclose(head, torch.tensor([-0.14073, -0.14405, -0.03132]), atol=1e-5), head
    total = sum(t.double().sum().item() for t in a.tensors.values())
    assert total == pytest.approx(288.297453, abs=1e-4)
    assert tiny.tokenizer.fingerprint.startswith("7ace6e69e8a885fc")
    assert tiny.tokenizer.encode("The quick") == [0, 297, 222, 82, 86, 74, 68, 76]


def test_tiny_tokenizer_round_trips_text(tiny) -> None:
    tok = tiny.tokenizer
    assert tok.vocab_size < tiny.config.vocab_size == 512  # embedding rows beyond the vocab
    assert tok.add_bos and tok.bos_token_id == 0 and tok.eos_token_id == 1
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and max(ids) < tok.vocab_size
        assert tok.decode(ids[1:]) == text
    chat = tok.decode(tok.apply_chat_template(CHAT))
    assert chat == "system: You are terse.</s>\nuser: Où est le café? ☕</s>\nassistant:"


def test_tiny_exported_folder_loads_as_the_same_model(tiny, tmp_path: Path) -> None:
    folder = export_hf_folder("tiny-random", tmp_path, progress=False)
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    again = load_model(str(folder), progress=False)
    assert_same_model(tiny, again)
    assert_same_tokenizer(tiny.tokenizer, again.tokenizer)


def test_tokenizer_pickles(tiny) -> None:
    tok = pickle.loads(pickle.dumps(tiny.tokenizer))
    assert_same_tokenizer(tok, tiny.tokenizer)


# --- streaming decode ----------------------------------------------------------------------------


def test_incremental_decoder_never_splits_a_character(tiny) -> None:
    tok = tiny.tokenizer
    text = "héllo 東京 🤖!"
    ids = tok.encode(text)[1:]  # the tiny vocabulary spells each non-ASCII byte as its own token
    decoder = IncrementalDecoder(tok)
    deltas = [decoder.feed(i) for i in ids]
    assert "".join(deltas) + decoder.flush() == text
    assert "" in deltas  # bytes were held back ...
    assert all("\ufffd" not in d for d in deltas)  # ... and never emitted half-done
    assert deltas[-1] == "!"


def test_incremental_decoder_flush_returns_held_bytes(tiny) -> None:
    tok = tiny.tokenizer
    first_byte_of_robot = tok.encode("🤖")[1]
    decoder = IncrementalDecoder(tok)
    assert decoder.feed_many(tok.encode("ok ")[1:]) == "ok "
    assert decoder.feed(first_byte_of_robot) == ""
    assert decoder.flush() == "\ufffd"  # an incomplete character, at the end of the stream
    assert decoder.feed_many(tok.encode("fine")[1:]) == "fine"


# --- errors --------------------------------------------------------------------------------------


def load_error(spec: str | Path) -> str:
    with pytest.raises(ModelError) as info:
        load_model(str(spec), progress=False)
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message
    return message


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    return export_hf_folder("tiny-random", tmp_path / "tiny", progress=False)


def test_unknown_model_name_lists_the_valid_ones() -> None:
    message = load_error("llama-9000")
    assert "unknown model 'llama-9000'" in message
    assert "smollm2-135m" in message and "tiny-random" in message


def test_missing_paths(tmp_path: Path) -> None:
    assert "does not exist" in load_error(tmp_path / "nope.gguf")
    assert "does not exist" in load_error(tmp_path / "no" / "folder")


def test_corrupt_gguf(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file" * 100)
    assert "cannot read GGUF file" in load_error(garbage)
    truncated = tmp_path / "truncated.gguf"
    with smollm2_gguf_path().open("rb") as f:
        truncated.write_bytes(f.read(300_000))  # cut off in the middle of the vocabulary
    assert "cannot read" in load_error(truncated)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    assert "not a .gguf file" in load_error(path)


def test_broken_config_json(tiny_folder: Path) -> None:
    (tiny_folder / "config.json").write_text("{not json")
    assert "cannot read" in load_error(tiny_folder) and "config.json" in load_error(tiny_folder)


def test_broken_safetensors(tiny_folder: Path) -> None:
    (tiny_folder / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0garbage")
    assert "cannot read weights" in load_error(tiny_folder)


def test_unsupported_architecture(tiny_folder: Path) -> None:
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64}
    (tiny_folder / "config.json").write_text(json.dumps(gpt2))
    assert "unsupported architecture 'GPT2LMHeadModel'" in load_error(tiny_folder)


def test_missing_tensor(tiny_folder: Path) -> None:
    weights = load_file(tiny_folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tiny_folder / "model.safetensors")
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in load_error(tiny_folder)


def test_shape_mismatch(tiny_folder: Path) -> None:
    config = json.loads((tiny_folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (tiny_folder / "config.json").write_text(json.dumps(config))
    message = load_error(tiny_folder)
    assert "has shape (128, 64), expected (96, 64)" in message


def test_folder_without_tokenizer(tiny_folder: Path) -> None:
    (tiny_folder / "tokenizer.json").unlink()
    assert "no tokenizer.json" in load_error(tiny_folder)


def test_folder_without_weights(tiny_folder: Path, tmp_path: Path) -> None:
    shutil.move(tiny_folder / "model.safetensors", tmp_path / "elsewhere.safetensors")
    assert "no *.safetensors" in load_error(tiny_folder)
