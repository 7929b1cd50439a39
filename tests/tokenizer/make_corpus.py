#!/usr/bin/python3
"""Deterministic tokenizer test corpus: a JSON list of strings on stdout.

    /usr/bin/python3 tests/tokenizer/make_corpus.py [--count 2400] [--seed 8] > corpus.json
    /usr/bin/python3 tests/tokenizer/make_corpus.py --megabytes 10 > bench.json

Covers English (contractions in both cases), Korean, Chinese, Japanese,
other scripts, emoji (ZWJ sequences, skin tones, flags), source code,
numbers (ASCII, fullwidth, Arabic-Indic, fractions), whitespace runs (tabs,
CR/LF, no-break and ideographic spaces) and the special tokens of every
tested tokenizer, alone and mixed at random.

Characters on which the reference JavaScript regex engine and PCRE2/Oniguruma
disagree by design are left out: U+0085 and U+FEFF (`\\s` membership differs)
and U+017F / U+212A (case-insensitive matches of "'s" differ). Characters new
in Unicode 15.0 are in (UNICODE15): pdserve matches text holding them with
ICU 72 (Unicode 15) instead of PCRE2 10.42 (Unicode 14). Characters newer
than 15.0 are not: Node's ICU knows them, Debian 12's does not.
"""

import argparse
import json
import random
import sys
import unicodedata

ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world!",
    "I can't believe it's already 2024; we'll see what they've done.",
    "SHE'S HERE AND WE'RE READY, AREN'T WE? I'M SURE YOU'LL AGREE, THEY'D SAY.",
    "Don't stop believin' -- hold on to that feelin'.",
    "A serving system is only useful if it serves the checkpoints people already have.",
    "Tokenization splits text into pieces; byte-pair encoding merges frequent pairs.",
    "e.g. Mr. Smith's dog (aged 3) barked at 7:45 a.m. on Jan. 5th.",
    "What's the difference between 'single' and \"double\" quotes?",
    "URLs like https://example.com/path?query=1&b=2#frag shouldn't break.",
    "email: someone@example.org, cc: another.person+tag@mail.co.uk",
    "Prices: $19.99, EUR 5,00, GBP 3.50 - 20% off!!!",
    "Well... that was unexpected?! (Or was it?)",
    "naive cafe resume: naïve café résumé façade coöperate",
    "ALL CAPS SENTENCE WITH NUMBERS 123 AND SYMBOLS #@!",
    "camelCaseIdentifier snake_case_identifier kebab-case-identifier",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    "It's 'quoted' text; it's also \u201csmart quoted\u201d and \u2018single smart\u2019.",
    "em\u2014dash, en\u2013dash, ellipsis\u2026 and bullet \u2022 points",
    "The year 1999 was followed by 2000, then 2001.",
]

KOREAN = [
    "안녕하세요", "안녕하세요, 세계!", "한국어 토크나이저 테스트입니다.",
    "저는 학생입니다. 만나서 반갑습니다.", "서울특별시 강남구 테헤란로 123",
    "오늘 날씨가 정말 좋네요 ㅋㅋㅋ", "ㄱㄴㄷㄹ ㅏㅑㅓㅕ", "대한민국의 수도는 서울이다",
    "프로그래밍 언어: 파이썬, 자바스크립트, 러스트", "가나다라마바사아자차카타파하",
]

CHINESE = [
    "你好，世界！", "我爱自然语言处理。", "今天天气很好，我们去公园散步吧。",
    "机器学习是人工智能的一个分支。", "中华人民共和国成立于1949年。",
    "這是繁體中文的句子。", "北京、上海、广州和深圳是一线城市。",
    "「引号」和『书名号』以及《书名》", "一二三四五六七八九十百千万亿",
    "大型语言模型推理服务需要高效的分词器。",
]

JAPANESE = [
    "こんにちは世界", "私は日本語を勉強しています。", "カタカナとひらがなと漢字",
    "東京都渋谷区", "ラーメンが食べたいです！", "ｶﾀｶﾅ半角", "今日は良い天気ですね。",
]

OTHER_SCRIPTS = [
    "Привет, мир! Как дела?", "Здравствуйте, меня зовут Иван.",
    "مرحبا بالعالم", "السلام عليكم ورحمة الله", "שלום עולם",
    "नमस्ते दुनिया", "हिन्दी में लिखा गया वाक्य।", "สวัสดีชาวโลก", "ภาษาไทยไม่มีช่องว่าง",
    "Γειά σου Κόσμε", "Ἀρχὴ ἥμισυ παντός", "Xin chào thế giới", "Tiếng Việt có dấu",
    "Merhaba dünya, İstanbul ılık", "Ça va? Où est la bibliothèque?", "Straße, Größe, Äpfel, Öl, Übung",
    "ქართული ენა", "Հայերեն", "ሰላም ለዓለም", "ᚠᚢᚦᚨᚱᚲ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙",
]

EMOJI = [
    "😀", "😀😃😄😁", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🇰🇷🇺🇸🇯🇵", "❤️", "✔️✅❌", "🔥🔥🔥",
    "I love pizza 🍕 and sushi 🍣!", "🏳️‍🌈", "🧑🏿‍🚀 to the moon 🚀🌕", "☕️ time", "1️⃣2️⃣3️⃣",
    "🙂🙃", "🤖 + 🧠 = 💡", "👋🏻👋🏼👋🏽👋🏾👋🏿", "🫠🫶",
]

CODE = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "#include <vector>\nstd::vector<int32_t> ids;\nids.reserve(1024);",
    "const x = {a: 1, b: [2, 3], c: \"four\"};\nconsole.log(JSON.stringify(x));",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
    "if __name__ == '__main__':\n    main()\n",
    "<html><body><div class=\"x\">Hi</div></body></html>",
    "{\"key\": \"value\", \"list\": [1, 2.5, -3e10, true, null]}",
    "fn main() -> Result<(), Box<dyn Error>> {\n    println!(\"{}\", 42);\n    Ok(())\n}",
    "x = lambda a, b: (a ** 2 + b ** 2) ** 0.5  # hypot",
    "    indented_line()\n        more_indented()\n\t\ttabbed()",
    "git commit -m 'fix: handle \\r\\n line endings' && git push origin main",
    "regex = r'^(?:[a-z0-9!#$%&*+/=?^_`{|}~-]+)@example\\.com$'",
    "a+=1;b-=2;c*=3;d/=4;e%=5;f<<=6;g>>=7;h&=8;i|=9;j^=10;",
    "/* comment */ // line comment\n# shell comment\n-- sql comment",
    "$ ls -la /usr/local/bin | grep -v '^d' | wc -l",
    "matrix[i][j] = sum(A[i][k] * B[k][j] for k in range(n))",
    "@decorator(arg=1)\nclass Foo(Bar, metaclass=Meta):\n    __slots__ = ('x',)\n",
]

NUMBERS = [
    "0", "7", "42", "123", "1234", "12345", "123456", "1234567", "12345678901234567890",
    "3.14159", "-273.15", "1,234,567.89", "1e-9", "0xDEADBEEF", "0b101010", "007",
    "2024-01-31", "12:34:56", "+1 (555) 123-4567", "1/2 + 3/4 = 5/4", "100%",
    "１２３４５", "٠١٢٣٤٥٦٧٨٩", "½ ¼ ¾", "x² + y³ = z⁴", "Ⅰ Ⅱ Ⅲ Ⅳ", "①②③", "१२३४",
    "v1.2.3-rc.4", "3.0e+08 m/s", "9999999999", "1 000 000",
]

WHITESPACE = [
    " ", "  ", "    ", "\t", "\t\t", "\n", "\n\n", "\n\n\n\n", "\r\n", "\r\n\r\n", " \n ",
    "  \n  \n", "\t \t \n", "a  b", "a   b    c", "trailing spaces   ", "   leading spaces",
    "line1\nline2\r\nline3\rline4", "tab\tseparated\tvalues", "no\u00a0break\u00a0space",
    "ideographic\u3000space", "en\u2002em\u2003thin\u2009spaces", "line\u2028separator",
    " \u00a0 \u3000 ", "word \n\n word", "\n \n \n", "x\n\n\n\ny", "   \t\n\r  ",
]

SPECIAL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|reserved_special_token_5|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<s>", "</s>", "<unk>",
    "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>", "[INST]", "[/INST]",
]

CHAT_SHAPED = [
    "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<s>[INST] What is 2+2? [/INST] 4</s>",
    "<\uff5cbegin\u2581of\u2581sentence\uff5c><\uff5cUser\uff5c>안녕<\uff5cAssistant\uff5c>",
    "text<|eot_id|>more text", "<|im_end|><|im_end|>", "a<s>b</s>c", " <|im_start|> spaced <|im_end|> ",
    "<|im_start", "<|im_end|", "< |im_end| >", "<<|eot_id|>>",
]

EDGE = [
    "", "a", "A", "'", "''", "'s", "'S", "'ll", "'LL", "x's", "X'S", "it's", "IT'S", "'re'", "s'",
    "a" * 300, "ab" * 200, "ha" * 150 + "!", "😀" * 60, "안" * 100, "1" * 200, "12 " * 100,
    "." * 100, "-" * 80, "=" * 64, "!" * 10 + "?" * 10, " " * 100, "\n" * 50, "\t" * 30,
    "e\u0301", "cafe\u0301", "A\u030a", "\u1100\u1161\u11a8", "n\u0303o", "\u0958",
    "\u00e9", "\u00c5", "\ufb01", "\u2126", "\u212b",
    "x\u200by", "zero\u200dwidth\u200cjoiners", "\u0627\u0644\u0639\u0631\u0628\u064a\u0629\u064b",
    "mixed안녕hello你好123😀", "123abc456def", "abc123", "!!!hello", "hello!!!", "a.b.c.d",
    "ﬁ ligature", "\U0001F600text\U0001F600", "\u2581metaspace\u2581char", "Ġ Ċ ĉ",
    "<0x41>", "<0xZZ>", "\\u0041", "%20%3A", "&amp;&lt;&gt;",
]

# New in Unicode 15.0: emoji (So), letters of new scripts (Lo), new digits
# (Nd), Kaktovik numerals (No), CJK Extension H, a Kannada letter.
UNICODE15 = [
    "\U0001FABF goose and \U0001FACE moose", "\U0001FAE8\U0001FA77\U0001FA75\U0001FA76",
    "hands \U0001FAF7\U0001FAF8!", "\U0001FA87\U0001FA88 music", "\U0001F6DC wifi",
    "\U00011F04\U00011F05\U00011F06 kawi", "\U0001E4D0\U0001E4D1\U0001E4D2 \U0001E4F1\U0001E4F2\U0001E4F3",
    "\U0001D2C0\U0001D2C1\U0001D2C5 kaktovik", "\U00031350\U00031351\U00031352",
    "\u0CF3 kannada", "x\U0001FABFy 12\U0001E4F4\U0001E4F5 3",
]

FRAGMENTS = ENGLISH + KOREAN + CHINESE + JAPANESE + OTHER_SCRIPTS + EMOJI + CODE + NUMBERS
SEPARATORS = [" ", "  ", "\n", "\n\n", "\t", "", " \n", "\r\n", ", ", ". ", "   "]

EXCLUDED = {"\u0085", "\ufeff", "\u017f", "\u212a"}


def mixed(rng: random.Random, fragments=FRAGMENTS) -> str:
    parts = []
    for _ in range(rng.randint(1, 6)):
        pool = rng.random()
        if pool < 0.12:
            parts.append(rng.choice(SPECIAL))
        elif pool < 0.22:
            parts.append(rng.choice(WHITESPACE))
        elif pool < 0.3:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
        else:
            frag = rng.choice(fragments)
            if rng.random() < 0.3:  # a random slice, so words are cut anywhere
                a = rng.randint(0, len(frag))
                b = rng.randint(a, len(frag))
                frag = frag[a:b]
            if rng.random() < 0.15:
                frag = frag.upper()
            parts.append(frag)
        parts.append(rng.choice(SEPARATORS))
    return "".join(parts)


def corpus(count: int, seed: int):
    fixed = (UNICODE15 + ENGLISH + KOREAN + CHINESE + JAPANESE + OTHER_SCRIPTS + EMOJI + CODE + NUMBERS +
             WHITESPACE + SPECIAL + CHAT_SHAPED + EDGE)
    out = list(fixed)
    rng = random.Random(seed)
    while len(out) < count:
        out.append(mixed(rng, UNICODE15 + FRAGMENTS))
    for s in out:
        assert not (set(s) & EXCLUDED), repr(s)
    return out


def bench_corpus(megabytes: float, seed: int):
    """Strings of about 4 KiB each, mixed as above, totalling `megabytes` MB of UTF-8.

    Without the Unicode 15 fragments: they are rare in real text, and a
    document holding one is matched by ICU's slower regex engine."""
    rng = random.Random(seed)
    out, total = [], 0
    while total < megabytes * 1e6:
        doc = []
        size = 0
        while size < 4096:
            s = mixed(rng)
            doc.append(s)
            size += len(s.encode("utf-8"))
        text = "".join(doc)
        out.append(text)
        total += len(text.encode("utf-8"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=2400)
    ap.add_argument("--seed", type=int, default=8)
    ap.add_argument("--megabytes", type=float, default=0,
                    help="instead: a benchmark corpus of this many MB")
    a = ap.parse_args(argv)
    strings = bench_corpus(a.megabytes, a.seed) if a.megabytes > 0 else corpus(a.count, a.seed)
    json.dump(strings, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
