"""Text corpus and reference (transformers) tokenizer for tests/test_tokenizer.py."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from core.tokenizer import gguf_tokenizer_key, tokenizer_cache_dir

# Each entry exercises a different part of the pipeline: the " " -> "▁" normalizer, added tokens matched
# in raw text ("\n" runs, "\t" runs, HTML tags), respelled all-space tokens, byte fallback, control tokens.
CORPUS: list[str] = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "   three leading spaces",
    "a  b   c    d     e      f",
    " " * 40,
    "tab\tseparated\t\tvalues\t\t\t",
    "\t\t\t\t",
    " \t \t  mixed\t  whitespace \t",
    "line1\nline2",
    "para1\n\npara2\n\n\npara3",
    "\n",
    "\n" * 45,
    "\r\nwindows\r\nline endings\r\n",
    "trailing newlines\n\n",
    "def f(x):\n    return x * 2  # double\n\nif __name__ == '__main__':\n\tprint(f(21))\n",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "int main(void) {\n  for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }\n}",
    "<table><tr><td>cell</td></tr></table> <b>bold</b> <s>strike</s> </s>",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트입니다",
    "丌丒丗 rare CJK \U00020000\U00020001",
    "emoji 🤖🚀 👍🏽 🇫🇷 👨\u200d👩\u200d👧 🫨🪿",
    "🀀🀁🀂 mahjong",
    "control \x00\x04\x07\x0b\x0c\x1e chars",
    "nbsp\u00a0and\u2009thin\u2028sep\u202f",
    "private use \ue00b\ue00c \U000f0000\U000f0001",
    "\U00010000\U00010001 linear b",
    "combining e\u0301 a\u0308 \u0332",
    "Ĳ ĳ Ŀ ƀ Ɓ",
    "Résumé naïve café — “quotes” … ½ ∑ ∞ ≠ 1234567890 3.14159",
    "Mixed: English, français, Deutsch, русский, العربية, हिन्दी, ไทย, 中文, 日本語, 한국어 🌍",
    "already\u2581has\u2581metaspace \u2581\u2581",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk><mask>",
    "<unused0> <unused98> <unused6241>",
    "<start_of_image>[multimodal]<end_of_image>",
    "< end_of_turn > <end_of_turn <<end_of_turn>> <END_OF_TURN> end_of_turn>",
    "x<end_of_turn>y <start_of_turn> z",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 20,
]

_POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
    ".,;:!?'\"()[]{}<>/\\|@#$%^&*-_=+~`",
    "   \t\n\n\r",
    "你好世界中文测试日本語한국어",
    "🤖🚀👍🏽🇫🇷🫨🪿🀀",
    "\x00\x04\x07\u00a0\u2009\u2028\ue00b\U00010000\U00020000\U000f0000丌丒",
    "éèàüöñçß\u0301\u2581",
]
_CHUNKS = [
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<unused7>", "<table>", "</s>", "\n\n\n", "\t\t",
]


def random_texts(n: int, seed: int = 0) -> list[str]:
    """Seeded random strings mixing every character class above, with special-token-looking chunks."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 30)):
            if rng.random() < 0.1:
                parts.append(rng.choice(_CHUNKS))
            else:
                parts.append(rng.choice(rng.choice(_POOLS)))
        texts.append("".join(parts))
    return texts


def reference_tokenizer(gguf: Path):
    """transformers' tokenizer for ``gguf``, and whether it came from the disk cache.

    Building it from the GGUF takes 20-100 s, so the first build is saved (save_pretrained) under
    ``<cache>/hf-reference/transformers-<version>-<tokenizer metadata sha>/`` and later sessions load
    that (a few seconds). The cached copy is only kept if its backend is identical to the fresh one.
    Set SLOTSERVE_TEST_FRESH_REFERENCE=1 to ignore the cache.
    """
    import transformers
    from transformers import AutoTokenizer

    key = gguf_tokenizer_key(gguf)
    entry = tokenizer_cache_dir() / "hf-reference" / f"transformers-{transformers.__version__}-{key}"
    if (entry / "tokenizer.json").is_file() and not os.environ.get("SLOTSERVE_TEST_FRESH_REFERENCE"):
        return AutoTokenizer.from_pretrained(str(entry)), True

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent))
        try:
            tok.save_pretrained(str(tmp))
            reloaded = AutoTokenizer.from_pretrained(str(tmp))
            fresh, saved = (json.loads(t.backend_tokenizer.to_str()) for t in (tok, reloaded))
            if fresh == saved and reloaded.encode("hi") == tok.encode("hi"):
                shutil.rmtree(entry, ignore_errors=True)
                os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # no cache, just slower next time
    return tok, False
