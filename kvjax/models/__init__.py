"""Model ports (dense and MoE transformers), HF and GGUF loaders, the tokenizer, `load_model`."""
