"""Evaluation: perplexity, attention error, retrieval and throughput benchmarks."""
