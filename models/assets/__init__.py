"""Real assets fetched from the package registries: the default Gemma 3 270M, the Gemma 4 tokenizer, photos."""
