"""TPU kernel bodies for Pallas' Mosaic TPU backend."""
