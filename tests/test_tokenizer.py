"""Tokenizer parity with transformers: HF folders, GGUF metadata (synthetic and SmolLM2), chat templates."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from batchgen.engine.loading.gguf.tokenizer import tokenizer_from_gguf
from batchgen.engine.tokenizer import ModelTokenizer

TRICKY = [
    "Hello world", " leading space", "  two  spaces  ", "trailing\n", "", "   ", "x",
    "digits 12345 and 3.14159, 2026-01-01", "a  1\n\n2\n   3", "1,000,000 items @ $9.99",
    "line1\nline2\r\n\tTabbed\n\n\n", "unicode: café naïve Ελληνικά 日本語 한국어 العربية",
    "emoji 😀👍🏽 🇫🇷 family 👨‍👩‍👧", "def f(x):\n    return x**2  # comment\n\tpass",
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>after", "<|im_start|", "don't I'll we've THEY'RE",
    "\u200b zero width", "ﬁ ligature", "A\u0301 combining", "word" * 50, "{'json': [1, 2, {\"k\": null}]}",
]
CHATS = [
    [{"role": "user", "content": "Hi 12 😀"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Summarize:\n  text"},
     {"role": "assistant", "content": "Ok."}, {"role": "user", "content": "Thanks"}],
]


def assert_same_as_hf(ours: ModelTokenizer, hf, texts=TRICKY, chats=CHATS) -> None:
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    for chat in chats:
        for gen in (True, False):
            text = ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert text == hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == hf.apply_chat_template(
                chat, add_generation_prompt=gen, tokenize=True, return_dict=False)
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_ids[0] == hf.eos_token_id
    assert ours.pad_token_id == hf.pad_token_id


def assert_token_bytes(ours: ModelTokenizer, texts=TRICKY) -> None:
    """Each token's bytes, joined, are the decoded text (multi-byte characters split across tokens included); a
    decoder that drops the prefix space it added leaves that space out of the text, not out of the first token."""
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        pieces = ours.token_bytes(ids)
        assert len(pieces) == len(ids)
        decoded = ours.decode(ids, skip_special_tokens=False)
        assert b"".join(pieces).decode() in (decoded, " " + decoded), text
    emoji = ours.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1 and b"".join(ours.token_bytes(emoji)).decode() in ("😀", " 😀")


# ---- HF folders -------------------------------------------------------------------------------------
def test_hf_dir_matches_transformers(tiny_model):
    from transformers import AutoTokenizer

    assert_same_as_hf(ModelTokenizer.from_hf_dir(tiny_model), AutoTokenizer.from_pretrained(tiny_model))


@pytest.mark.parametrize("bos_in_post_processor", [False, True])
def test_hf_dir_config_variants(tiny_model, tmp_path, bos_in_post_processor):
    """Chat template as a named list in tokenizer_config.json; BOS from tokenizer.json's post-processor
    (transformers 5 ignores the config's add_bos_token when tokenizer.json exists)."""
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    shutil.copytree(tiny_model, folder)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=not bos_in_post_processor, clean_up_tokenization_spaces=True,
               chat_template=[{"name": "tool_use", "template": "{{ raise_exception('no') }}"},
                              {"name": "default", "template": "{{ bos_token }}" + template}])
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    if bos_in_post_processor:
        tok = json.loads((folder / "tokenizer.json").read_text())
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}
        (folder / "tokenizer.json").write_text(json.dumps(tok))
    ours, hf = ModelTokenizer.from_hf_dir(folder), AutoTokenizer.from_pretrained(folder)
    assert (ours.encode("hi")[0] == ours.bos_token_id) == bos_in_post_processor
    assert ours.apply_chat_template(CHATS[0], tokenize=False).startswith("<|endoftext|><|im_start|>user")
    assert_same_as_hf(ours, hf, texts=TRICKY + ["Hello , world . I do n't know !"])


def test_hf_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        ModelTokenizer.from_hf_dir(tmp_path)


def test_chat_template_helpers_and_sandbox(tiny_model):
    from jinja2.exceptions import SecurityError, TemplateError

    tok = ModelTokenizer.from_hf_dir(tiny_model)
    msgs = [{"role": "user", "content": "héllo <b>"}]
    tok.chat_template = "{{ messages | tojson }}{{ eos_token }}"
    assert tok.apply_chat_template(msgs, tokenize=False) == json.dumps(msgs, ensure_ascii=False) + "<|im_end|>"
    tok.chat_template = "{{ messages[0] | tojson(indent=2) }}"
    assert tok.apply_chat_template(msgs, tokenize=False) == json.dumps(msgs[0], ensure_ascii=False, indent=2)
    tok.chat_template = "{% for m in messages %}{% if m.role != 'system' %}{{ raise_exception('bad role') }}{% endif %}{% endfor %}"
    with pytest.raises(TemplateError, match="bad role"):
        tok.apply_chat_template(msgs)
    tok.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(SecurityError):
        tok.apply_chat_template(msgs)
    tok.chat_template = "{{ messages.append(1) }}"
    with pytest.raises(SecurityError):
        tok.apply_chat_template(msgs)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template(msgs)


# ---- synthetic GGUF tokenizers ----------------------------------------------------------------------
def write_tokenizer_metadata(writer, hf_dir: Path, pre: str = "gpt2", add_bos: bool | None = False) -> None:
    """GGUF tokenizer metadata for a byte-level BPE HF tokenizer folder, as llama.cpp's converter writes it."""
    import gguf

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(vocab[cfg["bos_token"]])
    writer.add_eos_token_id(vocab[cfg["eos_token"]])
    writer.add_pad_token_id(vocab[cfg["pad_token"]])
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    chat = hf_dir / "chat_template.jinja"
    if chat.is_file():
        writer.add_chat_template(chat.read_text())


def _write_gguf(path: Path, fill) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _hf_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("pre,add_bos", [("gpt2", False), ("qwen2", None), ("llama-bpe", True)])
def test_gguf_byte_level_bpe_matches_transformers(tiny_model, tmp_path, pre, add_bos):
    path = _write_gguf(tmp_path / "tok.gguf", lambda w: write_tokenizer_metadata(w, tiny_model, pre, add_bos))
    ours = tokenizer_from_gguf(str(path))
    assert_same_as_hf(ours, _hf_gguf_tokenizer(path))
    assert_token_bytes(ours)
    assert (ours.encode("x")[0] == ours.bos_token_id) == bool(add_bos)
    assert len(ours.encode("<|im_start|>", add_special_tokens=False)) == 1


def _sentencepiece_metadata(writer) -> None:
    """A SentencePiece-style vocabulary (▁ word marks, byte tokens, scores, no merges) as llama files have."""
    import gguf
    from tokenizers import SentencePieceBPETokenizer

    from tests.tiny_models import CORPUS

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    learned = [t for t, _ in sorted(sp.get_vocab().items(), key=lambda kv: kv[1])]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = learned[:3] + byte_tokens + learned[3:] + ["<tool>"]
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (len(learned) - 3)
             + [gguf.TokenType.USER_DEFINED])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(learned) - 3)] + [0.0])
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")


def test_gguf_sentencepiece_bpe_matches_transformers(tmp_path):
    path = _write_gguf(tmp_path / "sp.gguf", _sentencepiece_metadata)
    ours, hf = tokenizer_from_gguf(str(path)), _hf_gguf_tokenizer(path)
    texts = TRICKY + ["The quick brown fox <tool> jumps", "Summarize the following article"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), text
    assert_token_bytes(ours, texts)
    assert ours.encode("fox")[0] == ours.bos_token_id == 1  # llama vocabularies add BOS by default
    assert ours.apply_chat_template(CHATS[0]) == hf.apply_chat_template(CHATS[0], tokenize=True, return_dict=False)


def _sentencepiece_vocab(specials: list[str]) -> tuple[list[str], list[int]]:
    """``specials``, the 256 byte tokens, then pieces learned on the corpus (merge order = vocabulary order)."""
    import gguf
    from tokenizers import SentencePieceBPETokenizer

    from tests.tiny_models import CORPUS

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(CORPUS, vocab_size=300, special_tokens=specials, show_progress=False)
    learned = [t for t, _ in sorted(sp.get_vocab().items(), key=lambda kv: kv[1])][len(specials):]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + learned
    types = [gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.BYTE] * 256 \
        + [gguf.TokenType.NORMAL] * len(learned)
    return tokens, types


def _write_sentencepiece_gguf(path: Path, arch: str, tokens: list[str], types: list[int], **ids) -> Path:
    import gguf

    def fill(w):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([-float(i) for i in range(len(tokens))])
        w.add_token_types(types)
        for key, value in ids.items():
            getattr(w, f"add_{key}")(value)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    fill(writer)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path


SENTENCEPIECE_TRICKY = TRICKY + ["The quick brown fox <tool> jumps", "  Summarize   the following article",
                                 "fox\n\n\nfox", " \t x"]
GEMMA_CHAT = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n"
              "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_gguf_gemma_sentencepiece_matches_transformers(tmp_path):
    """Gemma: no prefix space, whitespace runs stored as real spaces, merges ranked by vocabulary order."""
    import gguf

    tokens, types = _sentencepiece_vocab(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>",
                                          "<end_of_turn>"])
    tokens += ["  ", "   ", "    ", "<tool>"]  # as Gemma files spell them; <tool> user-defined
    types += [gguf.TokenType.USER_DEFINED] * 4
    path = _write_sentencepiece_gguf(tmp_path / "gemma.gguf", "gemma3", tokens, types, bos_token_id=2,
                                     eos_token_id=1, unk_token_id=3, pad_token_id=0, add_bos_token=True,
                                     chat_template=GEMMA_CHAT)
    ours, hf = tokenizer_from_gguf(str(path)), _hf_gguf_tokenizer(path)
    assert_same_as_hf(ours, hf, texts=SENTENCEPIECE_TRICKY)
    assert_token_bytes(ours, SENTENCEPIECE_TRICKY)
    assert ours.encode("fox")[0] == ours.bos_token_id == 2
    assert ours.decode(ours.encode("  two   spaces"), skip_special_tokens=True) == "  two   spaces"
    assert len(ours.encode("<start_of_turn>", add_special_tokens=False)) == 1


def test_gguf_phi3_sentencepiece_matches_transformers(tmp_path):
    """Phi-3: the prefix space comes from a normalizer; merges from the file's scores."""
    import gguf

    tokens, types = _sentencepiece_vocab(["<unk>", "<s>", "</s>"])
    tokens += ["<|user|>", "<|assistant|>", "<|end|>"]
    types += [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED]
    chat = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}<|assistant|>\n"
    path = _write_sentencepiece_gguf(tmp_path / "phi3.gguf", "phi3", tokens, types, bos_token_id=1,
                                     eos_token_id=2, unk_token_id=0, add_bos_token=False, chat_template=chat)
    ours, hf = tokenizer_from_gguf(str(path)), _hf_gguf_tokenizer(path)
    assert_same_as_hf(ours, hf, texts=SENTENCEPIECE_TRICKY, chats=[CHATS[0]])
    as_llama = tokenizer_from_gguf(str(_write_sentencepiece_gguf(tmp_path / "llama.gguf", "llama", tokens, types,
                                                                 bos_token_id=1, unk_token_id=0)))
    assert as_llama.encode("  hi", False) != ours.encode("  hi", False)  # Metaspace would drop a space


def test_gguf_unsupported_tokenizer_model(tmp_path):
    def fill(w):
        w.add_tokenizer_model("t5")
        w.add_token_list(["<pad>", "a"])

    with pytest.raises(NotImplementedError, match="t5"):
        tokenizer_from_gguf(str(_write_gguf(tmp_path / "t5.gguf", fill)))


# ---- the real SmolLM2 file --------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_gguf_tokenizer_matches_transformers(smollm2_gguf):
    ours = tokenizer_from_gguf(str(smollm2_gguf))
    hf = _hf_gguf_tokenizer(smollm2_gguf)
    assert_same_as_hf(ours, hf)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id, ours.vocab_size) == (1, [2], 2, 49152)
    assert ours.encode("<|im_start|>user") == [1, 4093]
    no_system = ours.apply_chat_template(CHATS[0], tokenize=False)
    assert no_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert ours.apply_chat_template(CHATS[1], tokenize=False).startswith("<|im_start|>system\nBe brief.<|im_end|>")
