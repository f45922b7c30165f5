"""The KV cache: quantizers, transforms (A, B), dense and paged caches, the page allocator."""
