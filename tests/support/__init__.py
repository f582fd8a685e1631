"""Test support: tiny models and tokenizer, random anchors, a torchrun launcher, a local fake Hub."""
