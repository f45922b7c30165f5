"""GPU kernel bodies for Pallas' Triton backend (a Mosaic GPU version can sit beside them)."""
