"""Writes ``runtime/kiln/runtime/data/calibration_mix.jsonl``, the default calibration data of
``kiln build``: a mixture of the domains a chat model serves.

Records (one JSON object a line; ``domain`` and ``source`` say where each came from):

* ``generated``: text the embedded model (SmolLM2-135M-Instruct, Apache-2.0) generates itself
  from a diverse prompt set, as LLM-QAT's data-free calibration does (Liu et al., 2023,
  "LLM-QAT: Data-Free Quantization Aware Training for Large Language Models"): chat answers
  (stored as ``messages``, rendered through the chat template at build time) and plain-text
  continuations of prose, code, markdown, numbers and other languages.  Sampled (temperature
  0.8, top-p 0.95, repetition penalty 1.1, a fixed seed per prompt), so the run is reproducible
  on the same torch build.
* ``cpython-3.11``: Python source of standard-library modules (Python Software Foundation
  License), none of which is in the held-out code text.
* ``cpython-3.11 docstrings``: the first part of the older docstring calibration text.
* ``kiln``: short passages written for Kiln by its authors (multilingual prose, numbers).

Run: ``.venv/bin/python tools/make_calibration_mix.py [CACHE.jsonl]`` (a few minutes on 2 CPU cores).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runtime/kiln/runtime/data/calibration_mix.jsonl"
HANDWRITTEN = Path(__file__).resolve().parent / "calibration_seed.jsonl"

CHAT_PROMPTS = [
    "Explain how a rainbow forms, in simple words.",
    "What are three good habits for staying healthy? Answer with a short list.",
    "Write a short poem about the sea at night.",
    "How do I make a cup of green tea?",
    "Summarize the story of Little Red Riding Hood in four sentences.",
    "My friend is sad because she lost her job. What could I say to her?",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a recipe for a simple tomato soup.",
    "A train travels 120 km in 1.5 hours. What is its average speed?",
    "Translate into French: The weather is lovely today and we are going to the park.",
    "¿Cuál es la capital de Argentina y qué se puede visitar allí?",
    "Écris un court paragraphe sur l'importance de la lecture.",
    "Was ist der Unterschied zwischen Wetter und Klima?",
    "Write a markdown table of four planets with their distance from the sun.",
    "List five tips for writing a good cover letter.",
    "Explain what a neural network is to a ten-year-old.",
    "Write a short email to my landlord asking to fix the heating.",
    "What causes the seasons on Earth?",
    "Write a SQL query that counts orders per customer.",
    "Tell me a joke about computers.",
    "How does compound interest work? Give an example with numbers.",
    "Write a haiku about autumn leaves.",
    "What should I pack for a three-day hiking trip?",
    "Describe the water cycle step by step.",
    "Write a JavaScript function that returns the largest number in an array.",
    "What are the pros and cons of working from home?",
    "Give me a short history of the printing press.",
    "How can I improve my sleep?",
    "Write a dialogue between a customer and a waiter in a restaurant.",
    "Convert 72 degrees Fahrenheit to Celsius and show the steps.",
    "Write a bash command that finds all .log files larger than 10 MB.",
    "Qual è il modo migliore per imparare una lingua straniera?",
    "Explique o que é a fotossíntese.",
    "用简单的话解释什么是人工智能。",
    "What is the Pythagorean theorem? Give an example.",
    "Write a product description for a reusable water bottle.",
    "Why is the sky blue?",
    "Plan a one-day itinerary for a visit to Rome.",
    "Explain recursion and give a small example in Python.",
]

TEXT_PROMPTS = [
    "Once upon a time, in a village at the edge of a great forest,",
    "The old lighthouse keeper climbed the stairs for the last time.",
    "Chapter 1\n\nThe letter arrived on a grey Tuesday morning,",
    "The history of the bicycle begins in the early nineteenth century,",
    "Photosynthesis is the process by which plants",
    "In economics, inflation refers to",
    "BREAKING: City council approves new budget after a long debate.",
    "Dear Sir or Madam,\n\nI am writing to",
    "# Getting started\n\nThis guide explains how to install",
    "## Shopping list\n\n- eggs\n- milk\n-",
    "| Country | Capital | Population (millions) |\n|---|---|---|\n| France | Paris |",
    "Step 1: Preheat the oven to 180 °C.\nStep 2:",
    "Q: What is the boiling point of water at sea level?\nA:",
    "def binary_search(items, target):\n    \"\"\"Return the index of target in sorted items.\"\"\"\n",
    "import numpy as np\n\n\ndef moving_average(x, window):\n",
    "class Stack:\n    def __init__(self):\n",
    "function debounce(fn, delay) {\n",
    "#include <stdio.h>\n\nint main(void) {\n",
    "SELECT name, COUNT(*) AS orders\nFROM customers\n",
    "{\n  \"name\": \"example\",\n  \"version\": \"1.0.0\",\n",
    "Quarterly results: revenue rose 12.4% to $3.2 billion, while",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    "The meeting is scheduled for 14:30 on 2024-03-15 in room 204.",
    "Il était une fois, dans un petit village de Provence,",
    "La ciudad de Barcelona es conocida por",
    "Die Geschichte der Stadt Berlin beginnt im",
    "Il Rinascimento italiano fu un periodo",
    "O Brasil é o maior país da América do Sul,",
    "User: Can you help me plan a birthday party?\nAssistant:",
    "Interviewer: Thank you for joining us today.\nGuest:",
]

MAX_TOKENS = 224


def generated_records() -> list[dict]:
    """Chat answers and continuations sampled from the embedded model."""
    from kiln.runtime import LLM, SamplingParams

    llm = LLM(model="builtin:smollm2-135m-instruct", device="cpu", max_num_seqs=35,
              num_kv_blocks=35 * 24)
    tok = llm.tokenizer
    prompts, kinds = [], []
    for p in CHAT_PROMPTS:
        prompts.append(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True))
        kinds.append(("chat", p))
    for p in TEXT_PROMPTS:
        prompts.append(p)
        kinds.append(("text", p))
    params = [SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, max_tokens=MAX_TOKENS,
                             seed=1000 + i) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    recs = []
    for (kind, p), o in zip(kinds, outs):
        text = o.outputs[0].text
        if kind == "chat":
            recs.append({"domain": "chat", "source": "generated",
                         "messages": [{"role": "user", "content": p}, {"role": "assistant", "content": text.strip()}]})
        else:
            recs.append({"domain": "text", "source": "generated", "text": p + text})
    return recs


MULTILINGUAL_STARTS = ("Il était", "La ciudad", "Die Geschichte", "Il Rinascimento", "O Brasil")
CODE_MODULES = ["heapq.py", "textwrap.py", "shlex.py"]
CODE_CHARS = 3500  # per module
DOCSTRING_CHARS = 5500

# With 128 samples of 128 tokens the domains' sizes give about: chat 40, text (prose, markdown,
# numbers, code openings) 35, code 20, multilingual 16, docstrings 10, numbers 7 samples.


def code_records() -> list[dict]:
    """The first ``CODE_CHARS`` of a few standard-library modules, cut at a blank line."""
    lib = Path(os.__file__).parent
    recs = []
    for name in CODE_MODULES:
        src = (lib / name).read_text(encoding="utf-8")[:CODE_CHARS]
        recs.append({"domain": "code", "source": f"cpython-3.11 Lib/{name}", "text": src[:src.rfind("\n\n")]})
    return recs


def docstring_records() -> list[dict]:
    """The start of the docstring text calibration used before the mixture."""
    text = (ROOT / "runtime/kiln/runtime/data/calibration.txt").read_text(encoding="utf-8")[:DOCSTRING_CHARS]
    return [{"domain": "docstrings", "source": "cpython-3.11 docstrings", "text": text[:text.rfind("\n\n")]}]


def main() -> int:
    cache = Path(sys.argv[1]) if len(sys.argv) > 1 else None  # optional: reuse (or keep) the generated records
    if cache is not None and cache.is_file():
        gen = [json.loads(line) for line in cache.read_text(encoding="utf-8").splitlines()]
    else:
        gen = generated_records()
        if cache is not None:
            cache.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in gen), encoding="utf-8")
    for r in gen:  # continuations in other languages are their own domain
        if r["domain"] == "text" and r["text"].startswith(MULTILINGUAL_STARTS):
            r["domain"] = "multilingual"
    recs = gen + code_records() + docstring_records()
    if HANDWRITTEN.is_file():
        recs += [json.loads(line) for line in HANDWRITTEN.read_text(encoding="utf-8").splitlines() if line.strip()]
    with open(OUT, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(recs)} records to {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
