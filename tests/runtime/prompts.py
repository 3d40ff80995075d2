"""Prompts shared by the runtime's correctness tests: short and long, raw and chat."""

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\nimport torch\n\nclass",
    # A long prompt: several KV blocks, many prefill chunks at a 32-token budget.
    ("The history of computing is long and varied. " * 12) + "In summary, the most important invention was",
    "Q: What is 12 times 12?\nA:",
    "Translate to French: 'Good morning, my friend.' ->",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "List three fruits."}],
    [{"role": "user", "content": "Explain recursion to a child. " * 8}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about cats."}],
]
MAX_NEW_TOKENS = 24
