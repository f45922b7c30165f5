"""Serving: the engine (prefill/decode loops), sampling, sharding rules and meshes."""
