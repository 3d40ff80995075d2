"""Work on either side of the engine core: turning user requests into token ids
(:mod:`.input`) and the core's token ids into text, stop strings and logprobs (:mod:`.output`).
Both run where the tokenizer lives: in the API server processes, or in-process for ``LLM``."""
