"""Text to token ids: GPT-2's tokenizer offline, the course corpus, next-token datasets."""
